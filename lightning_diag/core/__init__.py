"""The core: alerts, the rule registry, the tag vocabulary and argument checks.

Standard library only (no torch, no Lightning), so the report and the CLI can read it cheaply. Every other
package of lightning_diag depends on this one; it depends on none of them.
"""

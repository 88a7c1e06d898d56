"""Output: where scalars, text and images go (every logger of the trainer, TensorBoard extras) and the
TensorBoard custom-scalars dashboard layout."""

"""The trained embedded testbed: a procedural VQA task, training of the embedded model on it
(with random top-K and block dropping, so it degrades gracefully under the knobs), and the
dataset format ``ctrl profile`` reads."""

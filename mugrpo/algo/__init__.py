"""The algorithm's pure math: tensors in, tensors out; no model, config object or I/O."""

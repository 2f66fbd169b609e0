"""pathnorm for Keras 3 / TensorFlow: the exact proximal map of the 1-path-norm."""

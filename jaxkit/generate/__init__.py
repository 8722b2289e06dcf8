"""Text from a trained run: sampling with the key/value cache, the run or Hugging Face
directory a command opens, Hugging Face export and the lm-evaluation-harness model.

May import: train and everything below it.
"""

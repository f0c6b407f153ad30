"""What a run's model is worth: hellaswag.py scores a checkpoint, sample.py writes text with it."""

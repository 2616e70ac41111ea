"""One module per lesson (``lessonNN.py``) declaring its exercises and their cases."""

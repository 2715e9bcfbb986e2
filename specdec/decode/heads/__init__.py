"""Trained draft heads: the head (head.py), its drafter "head" (drafter.py) and the heads
shipped for the embedded models (one folder per target); training: specdec.train_head."""

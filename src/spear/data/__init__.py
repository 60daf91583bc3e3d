"""Calibration sequences (self-sampled or from a text file) and evaluation datasets."""

"""The compiled step: what `sg.function` and `sg.train_step` return, the checks of a call, checkpoints.
"""

"""Inpainting's pieces that sit below the model: the context encoder, the random and data masks, the
2.5-D slice stacks and the classic-fill channel (`context`); the tasks, what a run learns, generate or
inpaint (`tasks`); and the regression baseline that fills a hole in one pass (`regress`).

BraTS case folders at native resolution are imggen.volumes, which needs checkpoints and sampling and
so sits above the model. May import: the base modules (errors, tokens, augment, precision, classic);
imggen.config and imggen.model import this package (tests/test_layout.py: LAYERS).
"""

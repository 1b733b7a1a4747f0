"""specdec.train: training draft heads for a frozen target: Medusa heads (``specdec train-medusa``) and EAGLE
draft layers (``specdec train-eagle``), with their shared data, self-distillation and training loop.
"""

if __name__ != "specdec.train":  # imported as a bare 'train' (repo root on sys.path): run nothing
    from specdec.layout_guard import stand_in

    stand_in(__name__)

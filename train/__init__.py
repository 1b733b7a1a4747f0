"""specdec.train: Medusa head training (``specdec train-medusa``)."""

if __name__ != "specdec.train":  # imported as a bare 'train' (repo root on sys.path): run nothing
    from specdec.layout_guard import stand_in

    stand_in(__name__)

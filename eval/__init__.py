"""specdec.eval: the losslessness certificate and the acceptance / speed suite."""

if __name__ != "specdec.eval":  # imported as a bare 'eval' (repo root on sys.path): run nothing
    from specdec.layout_guard import stand_in

    stand_in(__name__)

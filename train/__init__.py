"""specdec.train: Medusa head training (``specdec train-medusa``)."""

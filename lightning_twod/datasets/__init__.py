"""Data modules: MovieLens-100K (real ratings, read from the ``recbole==1.2.1`` wheel) and synthetic
Criteo-like clicks (generated on the fly, reproducible by seed)."""

from lightning_twod.datasets.movielens import MovieLens100K, MovieLensDataModule
from lightning_twod.datasets.synthetic import SyntheticClicks, SyntheticDataModule

__all__ = ["MovieLens100K", "MovieLensDataModule", "SyntheticClicks", "SyntheticDataModule"]

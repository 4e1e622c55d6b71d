"""Data modules: MovieLens-100K (real ratings, read from the ``recbole==1.2.1`` wheel), synthetic
Criteo-like clicks (generated on the fly, reproducible by seed) and Criteo's own TSV click logs
(streamed from files the user gives)."""

from lightning_twod.datasets.criteo import CriteoDataModule, CriteoTSV
from lightning_twod.datasets.movielens import MovieLens100K, MovieLensDataModule
from lightning_twod.datasets.synthetic import SyntheticClicks, SyntheticDataModule

__all__ = ["CriteoDataModule", "CriteoTSV", "MovieLens100K", "MovieLensDataModule", "SyntheticClicks",
           "SyntheticDataModule"]

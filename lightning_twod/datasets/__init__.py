"""Data modules: MovieLens-100K (real ratings, read from the ``recbole==1.2.1`` wheel), synthetic
Criteo-like clicks (generated on the fly, reproducible by seed) and Criteo's own click logs
(streamed from the TSV files the user gives, or read from a prepared split of which each rank
reads its own row groups)."""

from lightning_twod.datasets.criteo import CriteoDataModule, CriteoTSV
from lightning_twod.datasets.criteo_prepare import prepare_criteo
from lightning_twod.datasets.criteo_prepared import CriteoPrepared
from lightning_twod.datasets.movielens import MovieLens100K, MovieLensDataModule
from lightning_twod.datasets.resumable import ResumableLoader
from lightning_twod.datasets.synthetic import SyntheticClicks, SyntheticDataModule

__all__ = ["CriteoDataModule", "CriteoPrepared", "CriteoTSV", "MovieLens100K", "MovieLensDataModule",
           "ResumableLoader", "SyntheticClicks", "SyntheticDataModule", "prepare_criteo"]

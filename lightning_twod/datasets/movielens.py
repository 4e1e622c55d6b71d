"""MovieLens-100K as click-through data: will a user rate a movie 4 or 5 stars?

The files are read at run time from the ``recbole==1.2.1`` wheel, which ships them as
``recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}``. Install it without its dependencies
(``pip install --no-deps recbole==1.2.1``; ``scripts/bootstrap.sh`` does). The package is located with
``importlib.metadata`` and never imported, and the files are never copied into this repository:
the MovieLens licence forbids redistributing them.

One sample per rating (100,000). Sparse features (one table each, ``0`` = unknown):

==============  ======  ===========================================================
feature         rows    content
==============  ======  ===========================================================
user_id         944     the user (raw ids 1..943)
item_id         1683    the movie (raw ids 1..1682)
age             8       age bucket: <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+
gender          3       F, M
occupation      22      21 occupations
zip_code        796     795 zip codes
release_year    74      the movie's release year (73 distinct years)
genres          20      19 genres, multi-hot: several ids per sample, mean-pooled
==============  ======  ===========================================================

Dense features (``num_dense = 3``): age / 100, (release year - 1900) / 100 (0 when unknown) and
the rating's time, scaled to [0, 1] over the data set. Label: ``rating >= 4`` (55.4 % positive).

Split (deterministic, independent of any random generator or library version): the ratings are
ordered by the CRC-32 of ``"{split_seed}:{user}:{item}"``; the first 80 % train, the next 10 %
validation, the last 10 % test (80,000 / 10,000 / 10,000 ratings).

``python -m lightning_twod.datasets.movielens`` prints the table sizes, split sizes and the
popularity baselines (AUC and NE of scoring every rating by its movie's training popularity).
"""

from __future__ import annotations

import importlib.metadata
import zlib
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_twod.core.features import SparseFeatures
from lightning_twod.datasets.sharding import eval_loader
from lightning_twod.metrics import AUC, NormalizedEntropy

PACKAGE, VERSION = "recbole", "1.2.1"
DATA_DIR = "recbole/dataset_example/ml-100k"
FEATURES = ("user_id", "item_id", "age", "gender", "occupation", "zip_code", "release_year", "genres")
MULTI_HOT = ("genres",)
AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # bucket b holds ages in [edge[b-1], edge[b]); 0 stays "unknown"
NUM_DENSE = 3
SPLITS = ("train", "validation", "test")
TABLE_ROWS = {"user_id": 944, "item_id": 1683, "age": 8, "gender": 3, "occupation": 22, "zip_code": 796,
              "release_year": 74, "genres": 20}
"""Rows of each feature's table (``0`` is the unknown id); the loader checks the files against it."""

INSTALL_HINT = (f"MovieLens-100K is read from the {PACKAGE}=={VERSION} wheel; install it without its "
                f"dependencies: pip install --no-deps {PACKAGE}=={VERSION} (./run.sh and ./test.sh do)")


def locate_files() -> dict[str, Path]:
    """Paths of ``ml-100k.{inter,user,item}`` inside the installed ``recbole`` distribution."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as err:
        raise FileNotFoundError(INSTALL_HINT) from err
    paths = {}
    for kind in ("inter", "user", "item"):
        path = Path(str(dist.locate_file(f"{DATA_DIR}/ml-100k.{kind}")))
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (installed {PACKAGE} {dist.version}). {INSTALL_HINT}")
        paths[kind] = path
    return paths


def _read(path: Path) -> tuple[list[str], list[list[str]]]:
    """An atomic file of RecBole: a header ``name:type`` per column, then tab-separated rows."""
    lines = path.read_text(encoding="utf-8").splitlines()
    header = [column.split(":")[0] for column in lines[0].split("\t")]
    rows = [line.split("\t") for line in lines[1:] if line]
    for row in rows:
        row.extend([""] * (len(header) - len(row)))
    return header, rows


def _vocabulary(tokens) -> dict[str, int]:
    """Sorted distinct non-empty tokens -> ids 1..n (0 is reserved for unknown)."""
    return {token: i + 1 for i, token in enumerate(sorted({t for t in tokens if t}))}


def _age_bucket(age: str) -> int:
    if not age.isdigit():
        return 0
    return 1 + sum(int(age) >= edge for edge in AGE_BUCKETS)


@dataclass
class MovieLensTensors:
    """The whole data set as tensors. Per rating: ``user``, ``item`` (row ids), ``label``, ``time``;
    per user row: ``age``, ``gender``, ``occupation``, ``zip_code``, ``age_years``; per item row:
    ``release_year``, ``year`` (calendar year or 0), ``genre_values`` / ``genre_lengths`` (jagged);
    ``split``: 0 train, 1 validation, 2 test."""

    user: Tensor
    item: Tensor
    label: Tensor
    time: Tensor
    split: Tensor
    age: Tensor
    gender: Tensor
    occupation: Tensor
    zip_code: Tensor
    age_years: Tensor
    release_year: Tensor
    year: Tensor
    genre_values: Tensor
    genre_lengths: Tensor
    table_rows: dict[str, int]


def load(split_seed: int = 0, val_fraction: float = 0.1, test_fraction: float = 0.1) -> MovieLensTensors:
    """Parse the three files into tensors and assign every rating to a split (see the module doc)."""
    paths = locate_files()
    _, users = _read(paths["user"])    # user_id age gender occupation zip_code
    _, items = _read(paths["item"])    # item_id movie_title release_year class
    _, ratings = _read(paths["inter"])  # user_id item_id rating timestamp
    num_users = max(int(u[0]) for u in users) + 1
    num_items = max(int(i[0]) for i in items) + 1
    vocab = {"gender": _vocabulary(u[2] for u in users), "occupation": _vocabulary(u[3] for u in users),
             "zip_code": _vocabulary(u[4] for u in users), "release_year": _vocabulary(i[2] for i in items),
             "genres": _vocabulary(g for i in items for g in i[3].split())}
    rows = {"user_id": num_users, "item_id": num_items, "age": len(AGE_BUCKETS) + 2,
            **{name: len(v) + 1 for name, v in vocab.items()}}
    if rows != TABLE_ROWS:
        raise ValueError(f"unexpected MovieLens-100K vocabulary sizes {rows} (expected {TABLE_ROWS}): is "
                         f"{PACKAGE}=={VERSION} installed?")

    user_cols = [[0] * num_users for _ in range(5)]  # age bucket, gender, occupation, zip, age in years
    for uid, age, gender, occupation, zip_code, *_ in users:
        for column, value in enumerate((_age_bucket(age), vocab["gender"].get(gender, 0),
                                        vocab["occupation"].get(occupation, 0), vocab["zip_code"].get(zip_code, 0),
                                        int(age) if age.isdigit() else 0)):
            user_cols[column][int(uid)] = value
    user_cols = torch.tensor(user_cols, dtype=torch.int64)
    release_year = torch.zeros(num_items, dtype=torch.int64)
    year = torch.zeros(num_items, dtype=torch.int64)
    genre_lists: list[list[int]] = [[] for _ in range(num_items)]
    for iid, _title, year_token, genres in items:
        release_year[int(iid)] = vocab["release_year"].get(year_token, 0)
        year[int(iid)] = int(year_token) if year_token.isdigit() else 0
        genre_lists[int(iid)] = [vocab["genres"][g] for g in genres.split()]

    parsed = [(int(u), int(i), float(r), int(float(t))) for u, i, r, t, *_ in ratings]
    table = torch.tensor(parsed, dtype=torch.float64).long()
    keys = [(zlib.crc32(f"{split_seed}:{u}:{i}".encode()), u, i) for u, i, *_ in parsed]
    order = sorted(range(len(parsed)), key=keys.__getitem__)
    num_val, num_test = round(len(ratings) * val_fraction), round(len(ratings) * test_fraction)
    num_train = len(ratings) - num_val - num_test
    split = torch.empty(len(ratings), dtype=torch.int64)
    split[torch.tensor(order[:num_train], dtype=torch.int64)] = 0
    split[torch.tensor(order[num_train:num_train + num_val], dtype=torch.int64)] = 1
    split[torch.tensor(order[num_train + num_val:], dtype=torch.int64)] = 2
    rating, time = torch.tensor([r for _, _, r, _ in parsed]), table[:, 3].double()
    return MovieLensTensors(
        user=table[:, 0], item=table[:, 1], label=(rating >= 4).float(),
        time=((time - time.min()) / (time.max() - time.min())).float(), split=split,
        age=user_cols[0], gender=user_cols[1], occupation=user_cols[2], zip_code=user_cols[3],
        age_years=user_cols[4], release_year=release_year, year=year,
        genre_values=torch.tensor([g for gs in genre_lists for g in gs], dtype=torch.int64),
        genre_lengths=torch.tensor([len(gs) for gs in genre_lists], dtype=torch.int64),
        table_rows=rows,
    )


class MovieLens100K(Dataset):
    """The ratings of one split; ``dataset[i]`` is ``i`` and ``collate`` builds whole batches:
    ``{"dense": [B, 3], "sparse": SparseFeatures (FEATURES order), "label": [B], "index": [B]}``
    (``index``: the rating's position in the split; ``-1``: a padding sample, see ``sharding``)."""

    def __init__(self, split: str = "train", data: MovieLensTensors | None = None, split_seed: int = 0) -> None:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; use one of {SPLITS}")
        self.data = data if data is not None else load(split_seed)
        self.split = split
        self.index = torch.nonzero(self.data.split == SPLITS.index(split)).squeeze(1)
        self.keys = list(FEATURES)
        genre_offsets = torch.cumsum(self.data.genre_lengths, 0) - self.data.genre_lengths
        self._genre_offsets = genre_offsets

    def __len__(self) -> int:
        return self.index.numel()

    def __getitem__(self, index: int) -> int:
        return index

    @property
    def labels(self) -> Tensor:
        return self.data.label[self.index]

    @property
    def items(self) -> Tensor:
        return self.data.item[self.index]

    def collate(self, indices: list[int]) -> dict[str, Tensor | SparseFeatures]:
        d = self.data
        index = torch.as_tensor(indices, dtype=torch.int64)
        rating = self.index[index.clamp(min=0)]  # padding (-1) reads rating 0 of the split
        user, item = d.user[rating], d.item[rating]
        single = torch.stack([user, item, d.age[user], d.gender[user], d.occupation[user], d.zip_code[user],
                              d.release_year[item]])  # [7, B], key-major
        genre_lengths = d.genre_lengths[item]
        starts = torch.repeat_interleave(self._genre_offsets[item], genre_lengths)
        within = torch.arange(starts.numel()) - torch.repeat_interleave(
            torch.cumsum(genre_lengths, 0) - genre_lengths, genre_lengths)
        genres = d.genre_values[starts + within]
        values = torch.cat([single.flatten(), genres])
        lengths = torch.cat([torch.ones(single.numel(), dtype=torch.int64), genre_lengths])
        year = d.year[item].float()
        dense = torch.stack([d.age_years[user].float() / 100, torch.where(year > 0, (year - 1900) / 100, 0.0),
                             d.time[rating]], dim=1)
        return {"dense": dense, "sparse": SparseFeatures(self.keys, values, lengths), "label": d.label[rating],
                "index": index}


class MovieLensDataModule(pl.LightningDataModule):
    """Train / validation / test splits of MovieLens-100K (see the module doc); ``batch_size`` is per
    rank. The model's tables must have ``TABLE_ROWS`` rows (``DLRM(table_rows=TABLE_ROWS, ...)``).

    ``test`` and ``predict`` both read the test split, each rating exactly once over all ranks
    (``sharding.EvalShardSampler``); batches carry ``index``, the rating's position in the split.
    """

    table_rows = TABLE_ROWS
    num_dense = NUM_DENSE

    def __init__(self, batch_size: int = 256, split_seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.split_seed, self.num_workers = batch_size, split_seed, num_workers
        self.data: MovieLensTensors | None = None

    def prepare_data(self) -> None:
        locate_files()  # fail early, with the install command, when the wheel is missing

    def setup(self, stage: str | None = None) -> None:
        if self.data is None:
            self.data = load(self.split_seed)
        self.train = MovieLens100K("train", self.data)
        self.val = MovieLens100K("validation", self.data)
        self.test = MovieLens100K("test", self.data)

    def _loader(self, dataset: MovieLens100K, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, collate_fn=dataset.collate,
                          num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return eval_loader(self.test, self.batch_size, self.trainer, self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        return eval_loader(self.test, self.batch_size, self.trainer, self.num_workers)


def popularity_baseline(data: MovieLensTensors | None = None, split: str = "validation") -> dict[str, float]:
    """Scores every rating of ``split`` by its movie's number of training ratings (popularity) and,
    as a second reference, by its movie's fraction of positive training ratings (smoothed); returns
    their AUC, and the NE of the training base rate (1.0 by definition) and of the positive rate."""
    data = data if data is not None else load()
    train, target = data.split == 0, data.split == SPLITS.index(split)
    rows = data.table_rows["item_id"]
    count = torch.bincount(data.item[train], minlength=rows).double()
    positive = torch.bincount(data.item[train], weights=data.label[train].double(), minlength=rows)
    base_rate = float(data.label[train].mean())
    rate = (positive + 10 * base_rate) / (count + 10)  # shrunk towards the base rate for rare movies
    items, labels = data.item[target], data.label[target].long()
    result = {}
    for name, score in (("popularity", count[items]), ("positive_rate", rate[items])):
        auc = AUC()
        auc.update(score.float(), labels)
        result[f"{name}_auc"] = float(auc.compute())
    ne = NormalizedEntropy(from_logits=False)
    ne.update(rate[items].float(), labels)
    result["positive_rate_ne"] = float(ne.compute())
    result["base_rate"] = base_rate
    return result


def main() -> None:
    data = load()
    sizes = {name: int((data.split == k).sum()) for k, name in enumerate(SPLITS)}
    print(f"MovieLens-100K from {locate_files()['inter'].parent}")
    print(f"ratings per split: {sizes}; positive (rating >= 4): {float(data.label.mean()):.3f}")
    print(f"table rows: {data.table_rows}")
    for split in ("validation", "test"):
        base = popularity_baseline(data, split)
        print(f"{split}: popularity AUC {base['popularity_auc']:.4f}; movie positive-rate AUC "
              f"{base['positive_rate_auc']:.4f}, NE {base['positive_rate_ne']:.4f}")


if __name__ == "__main__":
    main()

"""Import stand-in for `datasets` (bench-gpu only; see ../README.md).

`Dataset` is a minimal list of rows (TRL checks `isinstance(train_dataset, Dataset)`); everything else raises.
"""

from _bench_gpu_stub import Unavailable, module_getattr


class Dataset:
    """A map-style list of rows: `from_list`, `from_dict`, `len`, integer indexing, `column_names`."""

    cache_files: list = []

    def __init__(self, rows: list[dict]):
        self._rows = list(rows)

    @classmethod
    def from_list(cls, rows: list[dict]) -> "Dataset":
        return cls(rows)

    @classmethod
    def from_dict(cls, columns: dict) -> "Dataset":
        names = list(columns)
        return cls([dict(zip(names, values)) for values in zip(*columns.values())])

    @property
    def column_names(self) -> list[str]:
        return list(self._rows[0]) if self._rows else []

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, int):
            return self._rows[index]
        raise TypeError("the bench-gpu Dataset stand-in supports integer indexing only")

    def __getattr__(self, name):
        raise AttributeError(f"`Dataset.{name}` is not part of the bench-gpu stand-in for `datasets`")


class DatasetDict(Unavailable):
    pass


class IterableDataset(Unavailable):
    pass


class IterableDatasetDict(Unavailable):
    pass


__getattr__ = module_getattr("datasets")

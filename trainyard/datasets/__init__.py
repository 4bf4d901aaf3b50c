"""Map-style datasets: index -> sample, read in vectorized batches; ShardedBatches decides who
reads what. Large data is memory-mapped or read by Parquet row group, never loaded whole."""

from trainyard.datasets.base import MapDataset, Subset, as_rows

__all__ = ["MapDataset", "Subset", "as_rows"]

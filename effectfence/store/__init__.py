"""Stores: where intent records and domain seqs live. The core never imports a store driver."""

from effectfence.store.base import ClaimResult, CommitResult, FenceStore, Head
from effectfence.store.memory import MemoryStore

__all__ = ["ClaimResult", "CommitResult", "FenceStore", "Head", "MemoryStore"]

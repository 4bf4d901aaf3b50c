"""How the stratified train/val/test split shares out each class, before any row is read:
what it sets aside for val and test depends only on the class counts, the fractions and the
seed (sklearn draws each class's share first, then which rows), so a class too rare for it
is named before a run launches, not by sklearn's refusal inside the flow."""

from __future__ import annotations

import math

import numpy as np

from trainyard.config import SplitConfig

NEEDS_3_PER_CLASS = "a stratified train/val/test split needs at least 3 per class"


def held_out_per_class(counts: np.ndarray, split: SplitConfig) -> np.ndarray | None:
    """Rows of each class (`counts`, in sorted class order, as the split's strata number
    them) that the split's first call sets aside for val and test; None where that call
    refuses the sizes themselves, or the second would (fewer rows in a split than classes:
    preflight names that, in words that say what to change)."""
    from sklearn.model_selection import train_test_split  # ~1 s of imports no worker needs

    holdout = split.val_fraction + split.test_fraction
    ids = np.repeat(np.arange(len(counts)), counts)
    try:
        _, held = train_test_split(ids, test_size=holdout, stratify=ids, random_state=split.seed)
    except ValueError:
        return None
    test = math.ceil(split.test_fraction / holdout * len(held))  # as sklearn sizes it
    if min(test, len(held) - test) < len(counts):
        return None
    return np.bincount(held, minlength=len(counts))


def set_aside_too_few(counts: np.ndarray, split: SplitConfig) -> tuple[int, str] | None:
    """The first class (each with at least 3 rows) whose share the split sets aside is too
    small to go into both val and test, and what to tell the user; None if none is."""
    held = held_out_per_class(counts, split)
    if held is None or held.min() >= 2:
        return None
    rare = int(held.argmin())
    return rare, (
        f"the stratified split sets {held[rare]} of them aside for val and test, which need "
        "one each; add more of this class, or raise split.val_fraction and split.test_fraction"
    )

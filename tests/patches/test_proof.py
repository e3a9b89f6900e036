"""Proof records written from the rank process only."""

from __future__ import annotations

import time
from pathlib import Path

from patches.core.proof import ProofFile, in_loader_worker


class _Recording:
    """A dataset whose items update a proof record, as a collator wrapper does in a DataLoader worker; item 1 waits
    until ``merged`` exists (the rank has merged its own fact), so its update comes after the rank's."""

    def __init__(self, proof: ProofFile, merged: Path) -> None:
        self.proof, self.merged = proof, merged

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> dict[str, bool]:
        deadline = time.monotonic() + 120  # a guard against a hang, not the condition waited for
        while index == 1 and not self.merged.exists():
            assert time.monotonic() < deadline, "the rank never merged its fact"
            time.sleep(0.01)
        self.proof.update(first_batch={"index": index})
        return {"worker": in_loader_worker()}


def test_a_dataloader_worker_never_writes_a_proof_record(tmp_path):
    """A real DataLoader with one forked worker: the worker's copy of the record (the rank's as it was at the fork)
    would replace what the rank merged since; it writes nothing, and the rank's record stays whole. The same update
    in the rank itself is written."""
    import torch.utils.data

    proof = ProofFile(tmp_path, "demo_patch", 0)
    proof.start({"patch": "demo_patch", "status": "applied"})
    merged = tmp_path / "merged"
    loader = torch.utils.data.DataLoader(
        _Recording(proof, merged), batch_size=None, num_workers=1, multiprocessing_context="fork"
    )
    iterator = iter(loader)  # the worker forks here, holding the record as it is now
    proof.update(first_training_step={"calls": 3})  # what the rank merges after the fork
    merged.touch()  # the worker's update of item 1 comes after this
    items = list(iterator)
    assert [item["worker"] for item in items] == [True, True] and not in_loader_worker()
    record = proof.read()
    assert record["first_training_step"] == {"calls": 3} and "first_batch" not in record, record
    _Recording(proof, merged)[0]
    assert proof.read()["first_batch"] == {"index": 0}

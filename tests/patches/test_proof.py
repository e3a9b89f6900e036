"""Proof records written from the rank process only."""

from __future__ import annotations

from patches.proof import ProofFile, in_loader_worker


class _Recording:
    """A dataset whose items update a proof record, as a collator wrapper does in a DataLoader worker."""

    def __init__(self, proof: ProofFile) -> None:
        self.proof = proof

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> dict[str, bool]:
        self.proof.update(first_batch={"index": index})
        return {"worker": in_loader_worker()}


def test_a_dataloader_worker_never_writes_a_proof_record(tmp_path):
    """A real DataLoader with one forked worker: the worker's copy of the record (the rank's as it was at the fork)
    would replace what the rank merged since; it writes nothing, and the rank's record stays whole. The same update
    in the rank itself is written."""
    import torch.utils.data

    proof = ProofFile(tmp_path, "demo_patch", 0)
    proof.start({"patch": "demo_patch", "status": "applied"})
    loader = torch.utils.data.DataLoader(_Recording(proof), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")  # fmt: skip
    iterator = iter(loader)  # the worker forks here, holding the record as it is now
    proof.update(first_training_step={"calls": 3})  # what the rank merges after the fork
    items = list(iterator)
    assert [item["worker"] for item in items] == [True, True] and not in_loader_worker()
    record = proof.read()
    assert record["first_training_step"] == {"calls": 3} and "first_batch" not in record, record
    _Recording(proof)[0]
    assert proof.read()["first_batch"] == {"index": 0}

"""The layer plan's measurement inside the model's own forward, and the ranks' agreement on the plan.

Planted layers save tensors whose sizes are known: ``sin(x)`` saves its input (left out), ``exp`` saves its
output, ``sigmoid`` its output, and the product with the weight saves the sigmoid (already counted) and the
weight (a parameter, left out). So a planted layer keeps exactly two activations of the input's size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.common import REPO

ROWS, SEQ, WIDTH = 2, 24, 8
ACTIVATION = ROWS * SEQ * WIDTH * 4  # float32


def planted_stack(kinds=("deltanet", "deltanet", "attention")):
    """A stack of ``GradientCheckpointingLayer`` modules, each keeping two (``deltanet``) or three (``attention``)
    activations of its input's size, every one checkpointed non-reentrantly."""
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    from patches.checkpoint_all_layers import checkpoint_every_layer, non_reentrant_checkpoint

    class Planted(GradientCheckpointingLayer):
        def __init__(self, layer_type: str):
            super().__init__()
            self.layer_type = layer_type
            self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

        def forward(self, x, scale=None):
            kept = torch.sin(x).exp().sigmoid()
            if self.layer_type == "attention":
                kept = kept.tanh()  # saves its output: a third activation
            return kept * self.weight * (scale if scale is not None else 1.0)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Planted(kind) for kind in kinds)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x, scale=torch.full((WIDTH,), 0.9))  # a keyword input (left out, like RoPE's cos/sin)
            return x.sum()

    torch.manual_seed(0)
    stack = Stack().train()
    checkpoint_every_layer(stack, non_reentrant_checkpoint())
    return stack


def step(stack):
    import torch

    torch.manual_seed(1)
    x = torch.randn(ROWS, SEQ, WIDTH, requires_grad=True)
    stack(x).backward()
    return {n: p.grad.clone() for n, p in stack.named_parameters()}, x.grad.clone()


def test_the_meter_counts_what_a_layer_keeps_inside_the_forward_and_changes_nothing():
    from patches.planning.census import checkpoint_layers
    from patches.planning.meter import InForwardMeter

    reference = step(planted_stack())
    stack = planted_stack()
    meter = InForwardMeter(checkpoint_layers(stack))
    assert meter.measured == {"Planted:deltanet": "layers.0", "Planted:attention": "layers.2"}
    assert [layer.gradient_checkpointing for layer in stack.layers] == [False, True, False]
    grads, x_grad = step(stack)
    meter.close()

    costs = meter.costs
    assert costs["Planted:deltanet"].saved_bytes == 2 * ACTIVATION  # not the input, the keyword input, the weight
    assert costs["Planted:attention"].saved_bytes == 3 * ACTIVATION
    assert costs["Planted:deltanet"].layers == 2 and costs["Planted:attention"].layers == 1
    assert all(c.seq_len == SEQ and c.forward_s > 0 for c in costs.values())
    assert meter.measured_bytes == 5 * ACTIVATION and not meter.errors
    for name, grad in reference[0].items():  # un-checkpointed or not, the same gradients
        assert (grads[name] - grad).abs().max() == 0, name
    assert (x_grad - reference[1]).abs().max() == 0
    step(stack)  # measured once: a second step changes nothing
    assert meter.costs == costs


def test_the_forward_is_timed_on_the_second_layer_of_a_kind_not_on_the_first_which_compiles(monkeypatch):
    """The meter's clock is replaced by one that advances only where a layer says so: the first DeltaNet-kind
    layer's forward "compiles" for 100 s, the second layer's first forward takes 2 s, the attention layer's 3 s,
    and every later call 50 s (a recompute in the backward, the second step). The kind with two layers is timed
    on its second, in the first step's forward only; the kind with one layer on that layer; the first layer's own
    time is kept beside."""
    import patches.planning.meter as layer_meter
    from patches.planning.census import checkpoint_layers
    from patches.planning.meter import InForwardMeter

    class Clock:
        now = 0.0

        def perf_counter(self):
            return self.now

    clock = Clock()
    monkeypatch.setattr(layer_meter, "time", clock)
    stack = planted_stack()
    meter = InForwardMeter(checkpoint_layers(stack))
    for index, first in enumerate((100.0, 2.0, 3.0)):  # runs after the meter's pre-hook: inside its window
        calls = []

        def advance(module, args, first=first, calls=calls):  # later calls (recompute, step 2) take 50 s
            clock.now += first if not calls else 50.0
            calls.append(1)

        stack.layers[index].register_forward_pre_hook(advance)
    assert meter.timed == {"Planted:deltanet": "layers.1", "Planted:attention": "layers.2"}
    step(stack)
    step(stack)
    meter.close()
    assert meter.costs["Planted:deltanet"].forward_s == 2.0 and meter.costs["Planted:attention"].forward_s == 3.0
    assert meter.first_forward_s == {"Planted:deltanet": 100.0, "Planted:attention": 3.0}
    assert meter.costs["Planted:deltanet"].saved_bytes == 2 * ACTIVATION  # the bytes still from the first layer


def test_the_meter_leaves_out_parameters_gathered_during_the_forward_and_measures_no_evaluation():
    """FSDP2 all-gathers a layer's parameters in a pre-forward hook registered first and frees them after:
    the saved weight is then a tensor that exists only during the forward, and must still count as a
    parameter. A forward without gradients (evaluation) is not measured."""
    import torch

    from patches.planning.census import checkpoint_layers
    from patches.planning.meter import InForwardMeter

    stack = planted_stack(("deltanet",))
    layer = stack.layers[0]
    sharded = layer.weight

    def gather(module, args):
        module.weight = torch.nn.Parameter(sharded.detach().clone())  # a new storage, as an all-gather makes

    layer.register_forward_pre_hook(gather, prepend=True)
    meter = InForwardMeter(checkpoint_layers(stack))
    with torch.no_grad():
        stack(torch.randn(ROWS, SEQ, WIDTH))
    assert meter.costs == {}
    step(stack)
    meter.close()
    assert meter.costs["Planted:deltanet"].saved_bytes == 2 * ACTIVATION


def test_a_meter_that_counted_the_weight_would_be_caught():
    """The exact sizes above can fail: the same layer's saved tensors with the weight counted are more."""
    import torch

    from patches.planning.meter import SavedBytes

    stack = planted_stack(("deltanet",))
    x = torch.randn(ROWS, SEQ, WIDTH, requires_grad=True)
    counter = SavedBytes(torch.nn.Module(), [x])  # a module without the layer's parameters
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        stack.layers[0].forward(x)
    assert counter.total() == 2 * ACTIVATION + WIDTH * 4


@pytest.mark.usefixtures("restore_patches")
def test_a_single_process_agrees_with_itself():
    from patches.planning.budget import LayerCost
    from patches.planning.ranks import agree_costs, agree_counts

    costs = {"a": LayerCost("a", 3, 1000, 0.5, 10)}
    agreed, seq = agree_costs(costs, {"a": 3, "b": 1}, 10, "cpu")
    assert agreed == costs and seq == 10
    assert agree_counts({"a": 2}, {"a": 3, "b": 1}, "cpu") == {"a": 2}


pytest_plugins = ["tests.support.patch_fixtures"]

RANK_SCRIPT = r"""
import json, os, sys
import torch.distributed as dist
from patches.planning.budget import LayerCost, plan
from patches.planning.ranks import agree_costs, agree_counts

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
kinds = {"deltanet": 3, "attention": 1}
# rank 0 saw 40 tokens and timed the DeltaNet layer as dearer; rank 1 saw 20 tokens, the attention layer dearer,
# and could not measure the DeltaNet layer at all
costs = ({"deltanet": LayerCost("deltanet", 3, 4000, 0.004, 40),
          "attention": LayerCost("attention", 1, 4000, 0.002, 40)}
         if rank == 0 else {"attention": LayerCost("attention", 1, 2400, 0.003, 20)})
agreed, seq = agree_costs(costs, kinds, 40 if rank == 0 else 20, "cpu")
by_count = plan(agreed, count=2).uncheckpointed
own_budget = {"deltanet": 3, "attention": 1} if rank == 0 else {"deltanet": 1, "attention": 1}
counts = agree_counts(own_budget, kinds, "cpu")
out = {"agreed": {k: [c.saved_bytes, c.forward_s, c.seq_len] for k, c in agreed.items()}, "seq": seq,
       "by_count": agree_counts(by_count, kinds, "cpu"), "counts": counts}
open(sys.argv[1] + f".rank{rank}", "w").write(json.dumps(out))
dist.destroy_process_group()
"""


def test_two_gloo_ranks_plan_from_the_same_costs_and_take_the_fewest_layers(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
        str(tmp_path / "out"),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"out.rank{r}").read_text()) for r in (0, 1)]
    # per token: DeltaNet 100 B and 1e-4 s (rank 0 only); attention max(100, 120) B and max(5e-5, 1.5e-4) s
    assert results[0]["agreed"] == {"deltanet": [4000, 0.004, 40], "attention": [4800, 0.006, 40]}
    assert results[1]["agreed"] == {"deltanet": [2000, 0.002, 20], "attention": [2400, 0.003, 20]}
    # the same order on both ranks (attention: 1.25e-6 s per byte against 1e-6), so one count plan
    assert results[0]["by_count"] == results[1]["by_count"] == {"attention": 1, "deltanet": 1}
    assert results[0]["counts"] == results[1]["counts"] == {"deltanet": 1, "attention": 1}

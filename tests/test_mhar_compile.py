"""Per-block torch.compile of the MHAR model: the blocks' bodies compile to one graph whatever
the source count, nothing breaks the graphs, and the numbers are eager's."""

import copy

import pytest
import torch
from conftest import REPO
from tiny_runs import routed_tiny_model
from torch._dynamo.utils import counters

from mhar_titan.config import parse_config
from mhar_titan.model.parallelize import wrap_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_per_block_compile_makes_a_bounded_number_of_graphs_and_matches_eager(backend):
    num_blocks = 2
    eager = routed_tiny_model(seq=16, num_blocks=num_blocks, backend=backend, device=DEVICE)
    compiled = copy.deepcopy(eager)
    tiny = str(REPO / "configs" / "tiny_cpu.toml")
    config = parse_config(["--job.config_file", tiny, "--compile.enable", "--activation_checkpoint.mode", "full"])

    torch._dynamo.reset()
    counters.clear()
    tokens = torch.randint(0, eager.vocab_size, (1, 16), device=DEVICE)
    wrap_blocks(compiled, config, compile_model=True)
    for _ in range(2):  # the second pass must reuse the graphs
        out = compiled(tokens)
        out.float().pow(2).mean().backward()
    # Two graphs for the blocks' bodies (the routing runs outside them, so the number of sources does
    # not reach them): a block's first layer, and the later ones, which take the running block delta;
    # the torch backend's sites one per source count.
    graphs = 2 + (num_blocks if backend == "torch" else 0)
    assert counters["stats"]["unique_graphs"] == graphs
    with torch.no_grad():  # validation: the same graphs again without grad, none left to eager
        evaluated = compiled(tokens)
    assert counters["stats"]["unique_graphs"] == 2 * graphs
    assert not counters["graph_break"]
    torch.testing.assert_close(evaluated, out, rtol=0, atol=0)

    ref = eager(tokens)
    ref.float().pow(2).mean().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad / 2, p.grad, rtol=1e-3, atol=1e-6, msg=name)
    # wrapping changed no parameter name
    assert [n for n, _ in eager.named_parameters()] == [
        n.replace("._checkpoint_wrapped_module", "") for n, _ in compiled.named_parameters()
    ]

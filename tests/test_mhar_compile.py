"""Per-block torch.compile of the MHAR model: a bounded number of graphs, the numbers of eager."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torchtitan.config.job_config import Compile
from torchtitan.models.llama3.infra.parallelize import apply_compile

from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.model import MHARTransformer
from mhar_titan.model.parallelize import allow_routing_graphs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_per_block_compile_makes_a_bounded_number_of_graphs_and_matches_eager(backend):
    num_blocks = 2
    args = copy.deepcopy(FLAVORS["tiny"])
    args.max_seq_len = 32
    args.mhar = MHAR(enable=True, num_blocks=num_blocks, backend=backend)
    torch.manual_seed(0)
    eager = MHARTransformer(args)
    with torch.no_grad():
        eager.init_weights()
        for name, p in eager.named_parameters():
            if "_routing." in name:
                p.copy_(torch.randn_like(p) * (0.1 if name.endswith(".gate") else 1.0))
    compiled = copy.deepcopy(eager)

    torch._dynamo.reset()
    counters.clear()
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with torch._dynamo.config.patch(recompile_limit=1):  # allow_routing_graphs must raise it
        allow_routing_graphs(num_blocks)
        apply_compile(compiled, Compile(enable=True, backend="inductor"))
        for _ in range(2):  # the second pass must reuse the graphs
            out = compiled(tokens)
            out.float().pow(2).mean().backward()
        # One graph per source count, no graph breaks, plus one for layer 0 where its input is
        # sources[0] itself (Dynamo guards on the duplicate input). With triton and grad,
        # sources[0] is routing_source's alias of the embedding (kernels/routing.py) instead.
        graphs = num_blocks + (backend == "torch")
        assert counters["stats"]["unique_graphs"] == graphs
        with torch.no_grad():  # validation: the same graphs again without grad, none left to eager
            evaluated = compiled(tokens)
        assert counters["stats"]["unique_graphs"] == graphs + num_blocks + 1
    assert not counters["graph_break"]
    torch.testing.assert_close(evaluated, out, rtol=0, atol=0)

    ref = eager(tokens)
    ref.float().pow(2).mean().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad / 2, p.grad, rtol=1e-3, atol=1e-6, msg=name)

"""Validation CE by a token's position in its document and its document's length (components/val_bands.py)."""

import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX

from mhar_titan.components.val_bands import BANDS, LENGTH_BANDS, POSITION_BANDS, band_sums, split, token_bands

EOS = 0


def test_positions_count_from_each_documents_start_and_lengths_need_the_whole_document():
    row = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 3, 4]])  # a document begun earlier, a whole one, one cut at the end
    bands = token_bands(row, EOS)
    unknown, first = POSITION_BANDS.index("unknown"), POSITION_BANDS.index("0-63")
    assert bands["position"].tolist() == [[unknown] * 3 + [first] * 6]
    cut, short = LENGTH_BANDS.index("cut"), LENGTH_BANDS.index("0-255")
    assert bands["doc_length"].tolist() == [[cut] * 3 + [short] * 4 + [cut] * 2]
    long_row = torch.cat([torch.tensor([0]), torch.arange(1, 300)]).unsqueeze(0)  # a document from index 1 on
    position = token_bands(long_row, EOS)["position"][0]
    assert position[1:65].tolist() == [first] * 64 and position[65:257].tolist() == [first + 1] * 192
    assert position[257:].tolist() == [first + 2] * 43


def test_band_sums_are_the_per_token_ce_of_each_band_and_the_positions_cover_every_valid_token():
    torch.manual_seed(0)
    inputs = torch.randint(1, 50, (3, 40))
    inputs[0, 10] = inputs[1, 3] = inputs[1, 30] = inputs[2, 39] = EOS
    labels = torch.randint(0, 50, (3, 40))
    labels[inputs == EOS] = IGNORE_INDEX
    labels[2, :5] = IGNORE_INDEX
    logits = torch.randn(3, 40, 50)
    sums = band_sums(logits, labels, inputs, EOS, IGNORE_INDEX)
    n_pos = len(POSITION_BANDS)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    valid = labels.flatten() != IGNORE_INDEX
    for kind, columns in (("position", slice(0, n_pos)), ("doc_length", slice(n_pos, None))):
        band = token_bands(inputs, EOS)[kind].flatten()
        part = sums[:, columns]
        for b in range(part.shape[1]):
            chosen = valid & (band == b)
            assert part[1, b].item() == chosen.sum().item()
            assert abs(part[0, b].item() - ce[chosen].double().sum().item()) <= 1e-12 * max(1.0, part[0, b].item())
        assert part[1].sum().item() == valid.sum().item()  # every valid token in exactly one band of each kind
    named = split([sums.tolist()])
    assert list(named) == list(BANDS) and named["position"]["unknown"]["tokens"] == [int(sums[1, n_pos - 1])]

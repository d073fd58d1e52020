"""The sync's byte passes (qarl/native/bytes.c): zlib's CRC-32 value on every path (the folded
one, the tables, their seam), and a count of changed bytes equal to torch's."""

from __future__ import annotations

import zlib

import pytest
import torch

from qarl import native as nat
from qarl.native import bytes as nb
from qarl.quant.digests import tensor_crc

pytestmark = pytest.mark.skipif(not nat.available(), reason=f"native kernels: {nat.why_unavailable()}")

# below 64 bytes the tables alone; from 64 the folds, with 0-15 bytes left for the tables;
# a length past many 64-byte rounds; seeds: zlib's start, and states mid-stream
LENGTHS = [*range(0, 200), 255, 256, 1000, 4095, 4096, 4097, 65536 + 13, (1 << 20) + 7]


@pytest.mark.parametrize("seed", [0, 0x12345678, 0xFFFFFFFF])
def test_crc32_is_zlibs_at_every_length(seed):
    gen = torch.Generator().manual_seed(seed & 0xFFFF)
    for n in LENGTHS:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        assert nb.crc32(data, seed) == zlib.crc32(data.numpy(), seed), n


def test_crc32_continues_a_stream_as_zlib_does():
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    whole = zlib.crc32(data.numpy())
    for cut in (1, 63, 64, 100, 4096):
        assert nb.crc32(data[cut:], nb.crc32(data[:cut])) == whole, cut


def test_crc32_reads_a_tensors_bytes_in_order():
    """Any dtype, a view off its storage's start, a transposed one (read as its contiguous
    copy): the CRC of the bytes numpy would hand zlib."""
    x = torch.randn(37, 19, generator=torch.Generator().manual_seed(4))
    for t in (x, x[3:], x.t(), x.to(torch.bfloat16), (x * 50).to(torch.int8)):
        expect = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        assert nb.crc32(t) == expect == tensor_crc(t)


def test_a_single_flipped_bit_changes_the_crc():
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    before = nb.crc32(data)
    for at in (0, 15, 16, 63, 64, 2047, 4095):
        flipped = data.clone()
        flipped[at] ^= 1 << (at % 8)
        assert nb.crc32(flipped) != before, at


def test_count_changed_bytes_is_torchs():
    gen = torch.Generator().manual_seed(6)
    for n in (0, 1, 31, 32, 33, 1000, (1 << 20) + 5, 3 << 20):
        a = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        b = a.clone()
        flips = torch.rand(n, generator=gen) < 0.1
        b[flips] += torch.randint(1, 256, (int(flips.sum()),), dtype=torch.uint8, generator=gen)
        assert nb.count_changed_bytes(a, b) == int(flips.sum()) == int(torch.count_nonzero(a - b)), n
    codes = torch.randint(-127, 128, (64, 48), dtype=torch.int8, generator=gen)
    assert nb.count_changed_bytes(codes, codes.clone()) == 0
    assert nb.count_changed_bytes(codes, -codes) == int((codes != 0).sum())


def test_count_changed_bytes_refuses_other_sizes():
    with pytest.raises(ValueError, match="compares equal sizes; got 4 and 8 bytes"):
        nb.count_changed_bytes(torch.zeros(4, dtype=torch.uint8), torch.zeros(2, dtype=torch.float32))


def test_digests_are_the_same_without_the_native_kernels(monkeypatch):
    """A process without qarl.native (zlib) and one with it digest a state alike: an engine in
    another process may run either."""
    from qarl.quant import SCHEMES, digests

    state = {"a.weight": SCHEMES["w8a8-int8"].quantize(torch.randn(40, 64)), "norm": torch.randn(64)}
    native = digests.state_digests(state)
    monkeypatch.setattr(digests.native, "available", lambda: False)
    assert digests.state_digests(state) == native

"""The embedding table and LM head of a float32 CPU model held in fewer bytes, exactly.

A float32 model loaded on a CPU holds its tables upcast: 4 bytes a weight where fewer hold every value. The
checkpoint's own form comes back where it reproduces every value bit for bit:

    int8 blocks   an int8 code and an fp16 scale per block of 32 along the row, v = q d (a Q8_0 GGUF's tables,
                  dequantized on loading: the default model's); 1.06 bytes a weight. q d is exact in float32
                  (8 × 11 significant bits)
    fp16, bf16    the table in that dtype (a checkpoint stored in it); 2 bytes a weight

Lookups and the head's logits are computed in float32 as before: the head upcasts a block of rows (a power of two)
at a time into one 8 MiB scratch and multiplies there, so every product and sum is float32's. The logits equal
F.linear's on a 64-byte-aligned float32 table bit for bit (tested); a loaded table that is not aligned (the default
model's) takes another of MKL's one-row loops, whose sums differ from the scratch's by up to 1.6e-5: no greedy token
of 4,096 WikiText-2 positions changed. `hold_tables_compact(model)` swaps them into a runtime model
(runtime.model.use_kernels on a CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from spear.layer import LinearMethod
from spear.runtime.linear import DenseLinear

INT8_BLOCK = 32  # weights of a row that share one scale (a Q8_0 block)
SCRATCH_WEIGHTS = 1 << 21  # the float32 scratch the head multiplies through (8 MiB)
_ROWS = 4096  # rows checked and converted at a time (no whole float32 temporary)


def _int8_blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 codes [n, K], fp16 scales [n, K / 32]) with codes × scale = rows exactly, or None. A block's scale is
    its largest |v| over 127 (Q8_0's), rounded to fp16; 126, 128 and 125 are tried where that rounding moved it."""
    n, k = rows.shape
    b = rows.float().view(n, k // INT8_BLOCK, INT8_BLOCK)
    amax = b.abs().amax(-1)
    scale, found = torch.zeros_like(amax), amax == 0  # an all-zero block: scale 0, codes 0
    for top in (127, 126, 128, 125):
        d = (amax / top).half().float()
        q = (b / d.clamp(min=torch.finfo(torch.float16).tiny)[..., None]).round()
        good = ~found & (d > 0) & (q.abs().amax(-1) <= 127) & (q * d[..., None] == b).all(-1)
        scale = torch.where(good, d, scale)
        found |= good
    if not found.all():
        return None
    q = (b / scale.clamp(min=torch.finfo(torch.float16).tiny)[..., None]).round()
    return q.to(torch.int8).view(n, k), scale.half()


class CompactTable(nn.Module):
    """A float32 table [V, K] held as `values` (fp16 / bf16, or int8 codes with `scales`), read back exactly."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("values", values)
        self.register_buffer("scales", scales)

    @classmethod
    def of(cls, weight: torch.Tensor) -> "CompactTable | None":
        """The fewest bytes that hold every value of the float32 `weight` (module docstring), or None."""
        weight = weight.detach()
        if weight.shape[1] % INT8_BLOCK == 0:
            codes = torch.empty(weight.shape, dtype=torch.int8)
            scales = torch.empty(weight.shape[0], weight.shape[1] // INT8_BLOCK, dtype=torch.float16)
            for start in range(0, weight.shape[0], _ROWS):
                found = _int8_blocks(weight[start : start + _ROWS])
                if found is None:
                    break
                codes[start : start + _ROWS], scales[start : start + _ROWS] = found
            else:
                return cls(codes, scales)
        for dtype in (torch.float16, torch.bfloat16):
            if all(torch.equal(rows.to(dtype).float(), rows) for rows in weight.split(_ROWS)):
                values = torch.empty(weight.shape, dtype=dtype)
                for start in range(0, weight.shape[0], _ROWS):
                    values[start : start + _ROWS] = weight[start : start + _ROWS]
                return cls(values)
        return None

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def rows_into(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Rows start..stop in float32, written into out [stop - start, K]."""
        out.copy_(self.values[start:stop])
        if self.scales is not None:
            out.view(stop - start, -1, INT8_BLOCK).mul_(self.scales[start:stop, :, None])
        return out

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] in float32 [..., K]."""
        rows = self.values[ids].float()
        if self.scales is None:
            return rows
        return (rows.view(*ids.shape, -1, INT8_BLOCK) * self.scales[ids, :, None]).view(*ids.shape, -1)

    def nbytes(self) -> int:
        return self.values.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def extra_repr(self) -> str:
        held = "int8 × fp16 scale a block of 32" if self.scales is not None else str(self.values.dtype)
        return f"{tuple(self.shape)}, held as {held}, read in float32"


class CompactLinear(LinearMethod):
    """y = x Wᵀ + b in float32 over a CompactTable: W upcast a block of rows at a time into one float32 scratch and
    multiplied there. Blocks of a power of two rows: MKL's one-row product summed the rows of blocks of 1,170 or
    3,584 rows in another order than the whole table's (logits moved by up to 4e-6), and of 256 to 4,096 rows in the
    same (K = 576, 896, 2048; 1 and 2 threads). Time against F.linear on the float32 weight: bench/cpu_head.py."""

    def __init__(self, table: CompactTable, bias: torch.Tensor | None):
        super().__init__()
        self.table, self.bias = table, bias
        v, k = table.shape
        rows = min(v, 1 << max(6, (SCRATCH_WEIGHTS // k).bit_length() - 1))  # a power of two, at least 64
        self.scratch = torch.empty(rows, k, dtype=torch.float32)

    @property
    def in_features(self) -> int:
        return self.table.shape[1]

    @property
    def out_features(self) -> int:
        return self.table.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        out = x2.new_empty(x2.shape[0], self.out_features)
        step, bias = self.scratch.shape[0], None if self.bias is None else self.bias.float()
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            block = self.table.rows_into(start, stop, self.scratch[: stop - start])
            out[:, start:stop] = nn.functional.linear(x2, block, None if bias is None else bias[start:stop])
        return out.reshape(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.table.nbytes() + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


class CompactEmbedding(nn.Module):
    """An embedding lookup from a CompactTable, in float32, times the module's `embed_scale` where it had one
    (Gemma's scaled embedding, applied in float32 as there)."""

    def __init__(self, table: CompactTable, embed_scale: torch.Tensor | None):
        super().__init__()
        self.table = table
        self.embed_scale = embed_scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.table.lookup(tokens)
        return x if self.embed_scale is None else x * self.embed_scale.float()


def hold_tables_compact(model: nn.Module) -> int:
    """Give a float32 CPU model's embedding table and LM head (`model.embed`, `model.head`) CompactTables where they
    hold every value (a tied head shares the embedding's). The transformers modules they came from keep their
    float32 tensors, freed with that model (`spear serve` drops it once the engine is built). Returns the bytes
    saved."""
    embed, head = model.embed, model.head
    tables: dict[int, tuple[int, CompactTable | None]] = {}  # id(weight): (its float32 bytes, its table)

    def table_of(weight: torch.Tensor) -> CompactTable | None:
        if id(weight) not in tables:
            usable = weight.dtype == torch.float32 and weight.device.type == "cpu"
            tables[id(weight)] = (weight.nbytes, CompactTable.of(weight) if usable else None)
        return tables[id(weight)][1]

    plain = type(embed) is nn.Embedding or hasattr(embed, "embed_scale")
    if plain and getattr(embed, "max_norm", None) is None and (table := table_of(embed.weight)) is not None:
        model.embed = CompactEmbedding(table, getattr(embed, "embed_scale", None))
    if type(head) is DenseLinear and (table := table_of(head.weight)) is not None:
        model.head = CompactLinear(table, head.bias)
    # every table found is in use, a tied head's once
    return sum(nbytes - table.nbytes() for nbytes, table in tables.values() if table is not None)

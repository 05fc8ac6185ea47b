"""Serving caches and per-step attention metadata of the model.

Slots: every request owns one slot (an index < num_slots) in every cache. A negative slot index
marks a padded row: it reads nothing useful, writes nothing that any real slot sees, and its
outputs are garbage (finite) to be ignored.

Scratch space for padded rows: each buffer has one extra row at its end (GDN caches slot
``num_slots``, the flat KV buffers row ``num_slots * max_len``, the length buffers entry
``num_slots``). Writes of padded rows are redirected there with ``torch.where`` so every write is a
plain device scatter (no host read, no data-dependent shape); no real slot ever reads it.

Lengths (int32, on the device):
    kv_lens[slot]      tokens the target has committed for the slot (= positions 0..kv_lens-1 valid
                       in its KV caches and folded into its GDN states, pending ones included after
                       gdn_accept)
    mtp_kv_lens[slot]  tokens the MTP head's KV cache holds for the slot.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import List, Optional, Union

import torch


@dataclasses.dataclass
class KVCache:
    """One attention layer's KV cache in slots.

    k, v: [num_slots * max_len + 1, kv_heads, head_dim]; the last row is the scratch row for padded
    tokens. Token ``p`` of slot ``s`` lives at flat row ``s * max_len + p``; :attr:`k_cache` /
    :attr:`v_cache` view the real rows as ``[num_slots, max_len, kv_heads, head_dim]``.
    """

    k: torch.Tensor
    v: torch.Tensor
    num_slots: int
    max_len: int

    @classmethod
    def allocate(cls, num_slots: int, max_len: int, kv_heads: int, head_dim: int, dtype, device) -> "KVCache":
        rows = num_slots * max_len + 1
        z = dict(dtype=dtype, device=device)
        return cls(torch.zeros(rows, kv_heads, head_dim, **z), torch.zeros(rows, kv_heads, head_dim, **z),
                   num_slots, max_len)

    @property
    def scratch_row(self) -> int:
        return self.num_slots * self.max_len

    @property
    def k_cache(self) -> torch.Tensor:
        """[num_slots, max_len, kv_heads, head_dim] (a view)."""
        return self.k[:-1].view(self.num_slots, self.max_len, *self.k.shape[1:])

    @property
    def v_cache(self) -> torch.Tensor:
        return self.v[:-1].view(self.num_slots, self.max_len, *self.v.shape[1:])

    def clone(self) -> "KVCache":
        return KVCache(self.k.clone(), self.v.clone(), self.num_slots, self.max_len)


@dataclasses.dataclass
class ModelCache:
    """Everything a serving model keeps per slot.

    gdn:          [GDNStateCache] one per GDN layer, in layer order (``num_slots + 1`` slots each:
                  the last is the scratch slot; cache.max_draft = max_draft)
    kv:           [KVCache] one per full-attention layer of the target, in layer order
    mtp_kv:       [KVCache] one per MTP layer (empty when the model has no MTP head)
    kv_lens:      [num_slots] int32 view of ``kv_lens_buf`` [num_slots + 1]
    mtp_kv_lens:  [num_slots] int32 view of ``mtp_kv_lens_buf``
    """

    gdn: list
    kv: List[KVCache]
    mtp_kv: List[KVCache]
    kv_lens_buf: torch.Tensor
    mtp_kv_lens_buf: torch.Tensor
    num_slots: int
    max_len: int
    max_draft: int

    @property
    def kv_lens(self) -> torch.Tensor:
        return self.kv_lens_buf[:self.num_slots]

    @property
    def mtp_kv_lens(self) -> torch.Tensor:
        return self.mtp_kv_lens_buf[:self.num_slots]

    @property
    def device(self) -> torch.device:
        return self.kv_lens_buf.device

    def safe_slots(self, state_indices: torch.Tensor) -> torch.Tensor:
        """state_indices [N] -> [N] int64: each request's slot, a padded row's (negative) redirected to the scratch
        entry ``num_slots`` (every cache here has it), so writes of padded rows land there."""
        return torch.where(state_indices >= 0, state_indices, self.num_slots).long()

    def reset(self, slots) -> None:
        """Zero the given slots (GDN states, pending tokens, both lengths) for new requests.

        KV rows need no zeroing: a length of 0 makes every old row invisible. Host-side helper.
        """
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.device).reshape(-1)
        for c in self.gdn:
            c.reset(idx)
        self.kv_lens_buf[idx] = 0
        self.mtp_kv_lens_buf[idx] = 0

    def check(self) -> None:
        """Raise (ValueError, refgdn's words) a fault the GDN kernels recorded on the device since the last
        check, and clear it. One small device->host read per distinct fault buffer (allocate_cache shares one
        across the layers): call it where the host syncs anyway, never inside graph capture."""
        seen = set()
        for c in self.gdn:
            if c.err.data_ptr() not in seen:
                seen.add(c.err.data_ptr())
                c.check()

    def clone(self) -> "ModelCache":
        return ModelCache([c.clone() for c in self.gdn], [c.clone() for c in self.kv], [c.clone() for c in self.mtp_kv],
                          self.kv_lens_buf.clone(), self.mtp_kv_lens_buf.clone(), self.num_slots, self.max_len,
                          self.max_draft)


@dataclasses.dataclass
class StepMetadata:
    """Per-step attention metadata: device int32 tensors only (a later issue copies them into
    CUDA-graph static buffers; rebuild them for every step, never reuse another step's).

    state_indices   [N]    slot of each request; -1 = padded row
    query_start_loc [N+1]  request n owns tokens [qsl[n], qsl[n+1]) of this step (tokens at or past
                           qsl[N] are padding)
    positions       [T]    absolute position of each token (0 for padding tokens)
    seq_lens        [N]    length after the step: start + tokens of the request (0 for padded rows)
    slot_mapping    [T]    flat KV row ``slot * max_len + position`` written by each token; -1 for
                           padding tokens and for positions >= max_len (never written)
    token_slots     [T]    slot of each token's request; -1 for padding
    attn_window     host int or None: attention reads KV rows [0, attn_window) only (must exceed every
                    position of the step; None = the whole max_len). Not a tensor: a CUDA graph
                    captures it as a constant (leave it None, or the capture's bound, there).
    """

    state_indices: torch.Tensor
    query_start_loc: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    token_slots: torch.Tensor
    attn_window: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.state_indices.shape[0]

    def tensors(self) -> list:
        """The six device tensors in field order (attn_window left out)."""
        return [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "attn_window"]

    def copy_(self, other: "StepMetadata") -> "StepMetadata":
        """Copy another metadata object's values into this one's buffers (static-buffer refresh)."""
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs)
        return self


def _need_int_vector(name: str, t, length: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor, got "
                         f"{type(t).__name__ if not isinstance(t, torch.Tensor) else list(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have shape [{length}], got [{t.shape[0]}]")


def build_step_metadata(kv_lens: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
                        num_tokens: int, max_len: int, position_offset: Union[int, torch.Tensor] = 0,
                        attn_window: Optional[int] = None) -> StepMetadata:
    """Attention metadata for one step, from device tensors with device ops only (no host reads).

    kv_lens: [num_slots] int (the lengths before the step: the target's or the MTP head's)
    state_indices: [N] int (-1 = padded row)   query_start_loc: [N+1] int   num_tokens: T (host int:
    the padded token count of the step)   position_offset: int, or a device int tensor [] or [N]
    added to every request's start position (e.g. a draft-step index kept on the device).
    attn_window: optional host bound on the positions the step attends to (see StepMetadata).

        start[n] = kv_lens[slot_n] + offset;  positions[t] = start[n(t)] + t - qsl[n(t)];
        seq_lens[n] = start[n] + qsl[n+1] - qsl[n];  slot_mapping[t] = slot * max_len + positions[t]

    Shapes and dtypes are checked on the host; values are not read.
    """
    _need_int_vector("kv_lens", kv_lens)
    _need_int_vector("state_indices", state_indices)
    N = state_indices.shape[0]
    _need_int_vector("query_start_loc", query_start_loc, N + 1)
    if not isinstance(num_tokens, numbers.Integral) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if not isinstance(max_len, numbers.Integral) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    dev = kv_lens.device
    for name, t in (("state_indices", state_indices), ("query_start_loc", query_start_loc)):
        if t.device != dev:
            raise ValueError(f"{name} must be on {dev} (kv_lens' device), got {t.device}")
    if attn_window is not None and (not isinstance(attn_window, numbers.Integral) or not 1 <= attn_window <= max_len):
        raise ValueError(f"attn_window must be None or an int in [1, max_len={max_len}], got {attn_window!r}")
    if isinstance(position_offset, torch.Tensor):
        if position_offset.dim() > 1 or (position_offset.dim() == 1 and position_offset.shape[0] != N):
            raise ValueError(f"position_offset must be an int, a scalar tensor or [N] = [{N}], "
                             f"got {list(position_offset.shape)}")
        if position_offset.device != dev:
            raise ValueError(f"position_offset must be on {dev}, got {position_offset.device}")
        offset = position_offset.to(torch.int32)
    elif isinstance(position_offset, numbers.Integral):
        offset = int(position_offset)
    else:
        raise ValueError(f"position_offset must be an int or an int tensor, got {type(position_offset).__name__}")

    i32 = torch.int32
    si = state_indices.to(i32)
    qsl = query_start_loc.to(i32)
    real_req = si >= 0                                                        # [N]
    start = torch.where(real_req, kv_lens.to(i32)[si.clamp(min=0)] + offset, 0)         # [N]
    n_tok = qsl[1:] - qsl[:-1]                                                # [N]
    seq_lens = torch.where(real_req, start + n_tok, 0).to(i32)
    t = torch.arange(num_tokens, dtype=i32, device=dev)                      # [T]
    # request of each token: the n with qsl[n] <= t < qsl[n+1]; n == N for tokens past qsl[N]
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True, out_int32=True)   # [T]
    in_req = req < N
    req_c = req.clamp(max=max(N - 1, 0))
    if N == 0:
        tok_slot = torch.full_like(t, -1)
        pos = torch.zeros_like(t)
    else:
        tok_slot = torch.where(in_req, si[req_c], -1)
        pos = torch.where(tok_slot >= 0, start[req_c] + t - qsl[req_c], 0)
    live = (tok_slot >= 0) & (pos < max_len)
    slot_mapping = torch.where(live, tok_slot * max_len + pos, -1).to(i32)
    return StepMetadata(state_indices=si, query_start_loc=qsl, positions=pos.to(i32), seq_lens=seq_lens,
                        slot_mapping=slot_mapping, token_slots=tok_slot.to(i32),
                        attn_window=None if attn_window is None else int(attn_window))

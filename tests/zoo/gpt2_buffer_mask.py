"""GPT-2 as nanoGPT and HuggingFace's ``GPT2Model`` write it: the causal mask is a registered
buffer ``torch.tril(torch.ones(L, L)).view(1, 1, L, L)`` sliced ``self.bias[:, :, :T, :T]`` and
applied with ``masked_fill(... == 0, float("-inf"))``, the key padding added as HF's
``(1.0 - attention_mask[:, None, None, :]) * finfo.min``, scores divided by
``torch.full([], head_dim ** 0.5)``, HF ``Conv1D`` projections (``torch.addmm(b, x.view(-1, nx), w)
.view(...)``), learned absolute positions, the tanh-approximated GELU written out, and
``GPT2ForSequenceClassification``'s exit: logits at the last non-padding token found with
``eq(pad).int().argmax(-1) - 1`` modulo N."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}

PAD = 0


class Conv1D(nn.Module):
    """HF's transposed linear: weight ``[nx, nf]``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class NewGELUActivation(nn.Module):
    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = Conv1D(3 * n_embd, n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))

    def forward(self, x, attention_mask):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = q @ k.transpose(-2, -1)
        att = att / torch.full([], v.size(-1) ** 0.5, dtype=att.dtype, device=att.device)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = att + attention_mask
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = Conv1D(4 * n_embd, n_embd)
        self.c_proj = Conv1D(n_embd, 4 * n_embd)
        self.act = NewGELUActivation()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x, attention_mask):
        x = x + self.attn(self.ln_1(x), attention_mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Rec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.wte = nn.Embedding(num_items + 1, d)
        self.wpe = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(d, heads, max_len, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        self.score = nn.Linear(d, num_items + 1, bias=False)

    def forward(self, input_ids):
        B, T = input_ids.size()
        attention_mask = (input_ids != PAD).long()
        position_ids = torch.arange(0, T, dtype=torch.long, device=input_ids.device).unsqueeze(0)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        dtype = x.dtype
        attention_mask = attention_mask[:, None, None, :].to(dtype=dtype)
        attention_mask = (1.0 - attention_mask) * torch.finfo(dtype).min
        for block in self.h:
            x = block(x, attention_mask)
        logits = self.score(self.ln_f(x))
        sequence_lengths = torch.eq(input_ids, PAD).int().argmax(-1) - 1
        sequence_lengths = sequence_lengths % input_ids.shape[-1]
        return logits[torch.arange(B, device=logits.device), sequence_lengths]


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = GPT2Rec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids[:, 0] != PAD, name="gpt2_buffer_mask")

# grcompile score_mod captured-0071706ec5bf (kind='score'), graph 0
import torch

class ScoreMod(torch.nn.Module):
    def forward(self, score, q_pos, k_pos, q_side_0, q_side_1, k_side_2, k_side_3, table_0, table_1):
        # File: common.py:91 in forward, code: relative = positions.unsqueeze(0) - positions.unsqueeze(1)  # [i, j] -> j - i
        sub = k_pos - q_pos

        # File: common.py:92 in forward, code: return self.weight[relative + self.max_len - 1]  # [N, N]
        add = sub + 8;  sub = None
        sub_1 = add - 1;  add = None
        getitem = table_0[sub_1];  table_0 = sub_1 = None

        # File: common.py:112 in forward, code: delta = (query_ts.unsqueeze(2) - timestamps.unsqueeze(1)).abs().clamp(min=1)
        sub_2 = q_side_0 - k_side_2;  q_side_0 = k_side_2 = None
        abs_1 = sub_2.abs();  sub_2 = None
        clamp = abs_1.clamp(min = 1);  abs_1 = None

        # File: common.py:113 in forward, code: buckets = (torch.log(delta.float()) / 0.301).long().clamp(0, self.num_buckets)
        float_1 = clamp.float();  clamp = None
        log = torch.log(float_1);  float_1 = None
        truediv = log / 0.301;  log = None
        long = truediv.long();  truediv = None
        clamp_1 = long.clamp(0, 128);  long = None

        # File: common.py:114 in forward, code: return self.weight[buckets]  # [B, N, N]
        getitem_1 = table_1[clamp_1];  table_1 = clamp_1 = None

        # File: hstu.py:33 in forward, code: rab = self.position_bias(N, x.device).unsqueeze(0) + self.time_bias(timestamps, valid)
        add_1 = getitem + getitem_1;  getitem = getitem_1 = None

        # File: hstu.py:34 in forward, code: scores = torch.matmul(q, k.transpose(-2, -1)) + rab.unsqueeze(1)
        add_2 = score + add_1;  score = add_1 = None

        # File: hstu.py:35 in forward, code: attn = F.silu(scores) / N
        silu = torch.nn.functional.silu(add_2);  add_2 = None
        truediv_1 = silu / 8;  silu = None

        # No stacktrace found for following nodes
        full = torch.full((), 1, dtype = torch.bool)
        sub_3 = k_pos - q_pos;  k_pos = q_pos = None
        le = sub_3 <= 0;  sub_3 = None

        # File: common.py:77 in causal_padding_mask, code: causal = torch.tril(torch.ones(N, N, dtype=torch.bool, device=valid.device))
        where = torch.where(le, full, False);  le = full = None

        # File: common.py:78 in causal_padding_mask, code: return causal.unsqueeze(0) & valid.unsqueeze(1) & valid.unsqueeze(2)
        and_ = where & k_side_3;  where = k_side_3 = None
        and__1 = and_ & q_side_1;  and_ = q_side_1 = None

        # File: hstu.py:36 in forward, code: attn = attn * causal_padding_mask(valid).unsqueeze(1)
        mul = truediv_1 * and__1;  truediv_1 = and__1 = None
        return mul


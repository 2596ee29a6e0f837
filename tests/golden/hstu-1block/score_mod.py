# grcompile score_mod captured-0071706ec5bf (kind='score'), graph 0
import torch

class ScoreMod(torch.nn.Module):
    def forward(self, score, q_pos, k_pos, q_side_0, q_side_1, k_side_2, k_side_3, table_0, table_1):
        # No stacktrace found for following nodes
        sub = k_pos - q_pos
        add = sub + 8;  sub = None
        sub_1 = add - 1;  add = None
        getitem = table_0[sub_1];  table_0 = sub_1 = None
        sub_2 = q_side_0 - k_side_2;  q_side_0 = k_side_2 = None
        abs_1 = sub_2.abs();  sub_2 = None
        clamp = abs_1.clamp(min = 1);  abs_1 = None
        float_1 = clamp.float();  clamp = None
        log = torch.log(float_1);  float_1 = None
        truediv = log / 0.301;  log = None
        long = truediv.long();  truediv = None
        clamp_1 = long.clamp(0, 128);  long = None
        getitem_1 = table_1[clamp_1];  table_1 = clamp_1 = None
        add_1 = getitem + getitem_1;  getitem = getitem_1 = None
        add_2 = score + add_1;  score = add_1 = None
        silu = torch.nn.functional.silu(add_2);  add_2 = None
        truediv_1 = silu / 8;  silu = None
        full = torch.full((), 1, dtype = torch.bool)
        sub_3 = k_pos - q_pos;  k_pos = q_pos = None
        le = sub_3 <= 0;  sub_3 = None
        where = torch.where(le, full, False);  le = full = None
        and_ = where & k_side_3;  where = k_side_3 = None
        and__1 = and_ & q_side_1;  and_ = q_side_1 = None
        mul = truediv_1 * and__1;  truediv_1 = and__1 = None
        return mul


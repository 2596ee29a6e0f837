# grcompile graph 0: detect_padding
# after pass 2/5 'detect_padding'
# 0 rewrite(s); nodes 89 -> 89
# counters: detect_padding.pair_tensors=26, detect_padding.token_tensors=45, detect_padding.validity_sources=1
import torch

class GraphModule(torch.nn.Module):
    def forward(self, L_ids_: "i64[4, 8]", L_self_modules_item_embedding_parameters_weight_: "f32[21, 8]", L_self_modules_position_embedding_parameters_weight_: "f32[8, 8]", L_self_modules_blocks_modules_0_modules_uvqk_parameters_weight_: "f32[32, 8]", L_self_modules_blocks_modules_0_modules_position_bias_parameters_weight_: "f32[15]", L_timestamps_: "i64[4, 8]", L_self_modules_blocks_modules_0_modules_time_bias_parameters_weight_: "f32[129]", L_self_modules_blocks_modules_0_modules_output_parameters_weight_: "f32[8, 8]", L_self_modules_blocks_modules_0_modules_output_parameters_bias_: "f32[8]"):
        l_ids_ = L_ids_
        l_self_modules_item_embedding_parameters_weight_ = L_self_modules_item_embedding_parameters_weight_
        l_self_modules_position_embedding_parameters_weight_ = L_self_modules_position_embedding_parameters_weight_
        l_self_modules_blocks_modules_0_modules_uvqk_parameters_weight_ = L_self_modules_blocks_modules_0_modules_uvqk_parameters_weight_
        l_self_modules_blocks_modules_0_modules_position_bias_parameters_weight_ = L_self_modules_blocks_modules_0_modules_position_bias_parameters_weight_
        l_timestamps_ = L_timestamps_
        l_self_modules_blocks_modules_0_modules_time_bias_parameters_weight_ = L_self_modules_blocks_modules_0_modules_time_bias_parameters_weight_
        l_self_modules_blocks_modules_0_modules_output_parameters_weight_ = L_self_modules_blocks_modules_0_modules_output_parameters_weight_
        l_self_modules_blocks_modules_0_modules_output_parameters_bias_ = L_self_modules_blocks_modules_0_modules_output_parameters_bias_

        # File: common.py:53 in forward, code: valid = ids != self.config.pad_id
        valid: "b8[4, 8]" = l_ids_ != 0

        # File: common.py:54 in forward, code: positions = torch.arange(N, device=ids.device)
        positions: "i64[8]" = torch.arange(8, device = device(type='cpu'))

        # File: common.py:55 in forward, code: x = self.item_embedding(ids)
        check_index_default: "i64[4, 8]" = torch.ops.grcompile.check_index.default(l_ids_, 0, 21, "of item_embedding (21 rows) in input 'ids', looked up at common.py:55 in forward");  check_index_default = None
        x: "f32[4, 8, 8]" = torch.nn.functional.embedding(l_ids_, l_self_modules_item_embedding_parameters_weight_, 0, None, 2.0, False, False);  l_ids_ = l_self_modules_item_embedding_parameters_weight_ = None

        # File: common.py:58 in forward, code: x = x * math.sqrt(self.config.embedding_dim)
        x_1: "f32[4, 8, 8]" = x * 2.8284271247461903;  x = None

        # File: common.py:59 in forward, code: x = x + self.position_embedding(positions).unsqueeze(0)
        embedding_1: "f32[8, 8]" = torch.nn.functional.embedding(positions, l_self_modules_position_embedding_parameters_weight_, None, None, 2.0, False, False);  positions = l_self_modules_position_embedding_parameters_weight_ = None
        unsqueeze: "f32[1, 8, 8]" = embedding_1.unsqueeze(0);  embedding_1 = None
        x_2: "f32[4, 8, 8]" = x_1 + unsqueeze;  x_1 = unsqueeze = None

        # File: common.py:60 in forward, code: x = self.input_dropout(x) * valid.unsqueeze(-1)
        dropout: "f32[4, 8, 8]" = torch.nn.functional.dropout(x_2, 0.0, True, False);  x_2 = None
        unsqueeze_1: "b8[4, 8, 1]" = valid.unsqueeze(-1)
        x_3: "f32[4, 8, 8]" = dropout * unsqueeze_1;  dropout = unsqueeze_1 = None

        # File: hstu.py:27 in forward, code: normed = F.layer_norm(x, (D,), eps=1e-6)
        normed: "f32[4, 8, 8]" = torch.nn.functional.layer_norm(x_3, (8,), eps = 1e-06)

        # File: hstu.py:28 in forward, code: u, v, q, k = torch.split(F.silu(self.uvqk(normed)), [H * dv, H * dv, H * dqk, H * dqk], dim=-1)
        linear: "f32[4, 8, 32]" = torch._C._nn.linear(normed, l_self_modules_blocks_modules_0_modules_uvqk_parameters_weight_, None);  normed = l_self_modules_blocks_modules_0_modules_uvqk_parameters_weight_ = None
        silu: "f32[4, 8, 32]" = torch.nn.functional.silu(linear);  linear = None
        split = torch.functional.split(silu, [8, 8, 8, 8], dim = -1);  silu = None
        u: "f32[4, 8, 8]" = split[0]
        v: "f32[4, 8, 8]" = split[1]
        q: "f32[4, 8, 8]" = split[2]
        k: "f32[4, 8, 8]" = split[3];  split = None

        # File: hstu.py:29 in forward, code: q = q.view(B, N, H, dqk).transpose(1, 2)
        view: "f32[4, 8, 2, 4]" = q.view(4, 8, 2, 4);  q = None
        q_1: "f32[4, 2, 8, 4]" = view.transpose(1, 2);  view = None

        # File: hstu.py:30 in forward, code: k = k.view(B, N, H, dqk).transpose(1, 2)
        view_1: "f32[4, 8, 2, 4]" = k.view(4, 8, 2, 4);  k = None
        k_1: "f32[4, 2, 8, 4]" = view_1.transpose(1, 2);  view_1 = None

        # File: hstu.py:31 in forward, code: v = v.view(B, N, H, dv).transpose(1, 2)
        view_2: "f32[4, 8, 2, 4]" = v.view(4, 8, 2, 4);  v = None
        v_1: "f32[4, 2, 8, 4]" = view_2.transpose(1, 2);  view_2 = None

        # File: common.py:90 in forward, code: positions = torch.arange(N, device=device)
        positions_1: "i64[8]" = torch.arange(8, device = device(type='cpu'))

        # File: common.py:91 in forward, code: relative = positions.unsqueeze(0) - positions.unsqueeze(1)  # [i, j] -> j - i
        unsqueeze_2: "i64[1, 8]" = positions_1.unsqueeze(0)
        unsqueeze_3: "i64[8, 1]" = positions_1.unsqueeze(1);  positions_1 = None
        relative: "i64[8, 8]" = unsqueeze_2 - unsqueeze_3;  unsqueeze_2 = unsqueeze_3 = None

        # File: common.py:92 in forward, code: return self.weight[relative + self.max_len - 1]  # [N, N]
        add_1: "i64[8, 8]" = relative + 8;  relative = None
        sub_1: "i64[8, 8]" = add_1 - 1;  add_1 = None
        getitem_4: "f32[8, 8]" = l_self_modules_blocks_modules_0_modules_position_bias_parameters_weight_[sub_1];  l_self_modules_blocks_modules_0_modules_position_bias_parameters_weight_ = sub_1 = None

        # File: hstu.py:33 in forward, code: rab = self.position_bias(N, x.device).unsqueeze(0) + self.time_bias(timestamps, valid)
        unsqueeze_4: "f32[1, 8, 8]" = getitem_4.unsqueeze(0);  getitem_4 = None

        # File: common.py:109 in forward, code: next_ts = torch.cat([timestamps[:, 1:], timestamps[:, -1:]], dim=1)
        getitem_5: "i64[4, 7]" = l_timestamps_[(slice(None, None, None), slice(1, None, None))]
        getitem_6: "i64[4, 1]" = l_timestamps_[(slice(None, None, None), slice(-1, None, None))]
        next_ts: "i64[4, 8]" = torch.cat([getitem_5, getitem_6], dim = 1);  getitem_5 = getitem_6 = None

        # File: common.py:110 in forward, code: next_valid = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
        getitem_7: "b8[4, 7]" = valid[(slice(None, None, None), slice(1, None, None))]
        getitem_8: "b8[4, 1]" = valid[(slice(None, None, None), slice(None, 1, None))]
        zeros_like: "b8[4, 1]" = torch.zeros_like(getitem_8);  getitem_8 = None
        next_valid: "b8[4, 8]" = torch.cat([getitem_7, zeros_like], dim = 1);  getitem_7 = zeros_like = None

        # File: common.py:111 in forward, code: query_ts = torch.where(next_valid, next_ts, timestamps)
        query_ts: "i64[4, 8]" = torch.where(next_valid, next_ts, l_timestamps_);  next_valid = next_ts = None

        # File: common.py:112 in forward, code: delta = (query_ts.unsqueeze(2) - timestamps.unsqueeze(1)).abs().clamp(min=1)
        unsqueeze_5: "i64[4, 8, 1]" = query_ts.unsqueeze(2);  query_ts = None
        unsqueeze_6: "i64[4, 1, 8]" = l_timestamps_.unsqueeze(1);  l_timestamps_ = None
        sub_2: "i64[4, 8, 8]" = unsqueeze_5 - unsqueeze_6;  unsqueeze_5 = unsqueeze_6 = None
        abs_1: "i64[4, 8, 8]" = sub_2.abs();  sub_2 = None
        delta: "i64[4, 8, 8]" = abs_1.clamp(min = 1);  abs_1 = None

        # File: common.py:113 in forward, code: buckets = (torch.log(delta.float()) / 0.301).long().clamp(0, self.num_buckets)
        float_1: "f32[4, 8, 8]" = delta.float();  delta = None
        log: "f32[4, 8, 8]" = torch.log(float_1);  float_1 = None
        truediv: "f32[4, 8, 8]" = log / 0.301;  log = None
        long: "i64[4, 8, 8]" = truediv.long();  truediv = None
        buckets: "i64[4, 8, 8]" = long.clamp(0, 128);  long = None

        # File: common.py:114 in forward, code: return self.weight[buckets]  # [B, N, N]
        getitem_9: "f32[4, 8, 8]" = l_self_modules_blocks_modules_0_modules_time_bias_parameters_weight_[buckets];  l_self_modules_blocks_modules_0_modules_time_bias_parameters_weight_ = buckets = None

        # File: hstu.py:33 in forward, code: rab = self.position_bias(N, x.device).unsqueeze(0) + self.time_bias(timestamps, valid)
        rab: "f32[4, 8, 8]" = unsqueeze_4 + getitem_9;  unsqueeze_4 = getitem_9 = None

        # File: hstu.py:34 in forward, code: scores = torch.matmul(q, k.transpose(-2, -1)) + rab.unsqueeze(1)
        transpose_3: "f32[4, 2, 4, 8]" = k_1.transpose(-2, -1);  k_1 = None
        matmul: "f32[4, 2, 8, 8]" = torch.matmul(q_1, transpose_3);  q_1 = transpose_3 = None
        unsqueeze_7: "f32[4, 1, 8, 8]" = rab.unsqueeze(1);  rab = None
        scores: "f32[4, 2, 8, 8]" = matmul + unsqueeze_7;  matmul = unsqueeze_7 = None

        # File: hstu.py:35 in forward, code: attn = F.silu(scores) / N
        silu_1: "f32[4, 2, 8, 8]" = torch.nn.functional.silu(scores);  scores = None
        attn: "f32[4, 2, 8, 8]" = silu_1 / 8;  silu_1 = None

        # File: common.py:77 in causal_padding_mask, code: causal = torch.tril(torch.ones(N, N, dtype=torch.bool, device=valid.device))
        ones: "b8[8, 8]" = torch.ones(8, 8, dtype = torch.bool, device = device(type='cpu'))
        causal: "b8[8, 8]" = torch.tril(ones);  ones = None

        # File: common.py:78 in causal_padding_mask, code: return causal.unsqueeze(0) & valid.unsqueeze(1) & valid.unsqueeze(2)
        unsqueeze_8: "b8[1, 8, 8]" = causal.unsqueeze(0);  causal = None
        unsqueeze_9: "b8[4, 1, 8]" = valid.unsqueeze(1)
        and_: "b8[4, 8, 8]" = unsqueeze_8 & unsqueeze_9;  unsqueeze_8 = unsqueeze_9 = None
        unsqueeze_10: "b8[4, 8, 1]" = valid.unsqueeze(2)
        and__1: "b8[4, 8, 8]" = and_ & unsqueeze_10;  and_ = unsqueeze_10 = None

        # File: hstu.py:36 in forward, code: attn = attn * causal_padding_mask(valid).unsqueeze(1)
        unsqueeze_11: "b8[4, 1, 8, 8]" = and__1.unsqueeze(1);  and__1 = None
        attn_1: "f32[4, 2, 8, 8]" = attn * unsqueeze_11;  attn = unsqueeze_11 = None

        # File: hstu.py:37 in forward, code: out = torch.matmul(attn, v).transpose(1, 2).reshape(B, N, H * dv)
        matmul_1: "f32[4, 2, 8, 4]" = torch.matmul(attn_1, v_1);  attn_1 = v_1 = None
        transpose_4: "f32[4, 8, 2, 4]" = matmul_1.transpose(1, 2);  matmul_1 = None
        out: "f32[4, 8, 8]" = transpose_4.reshape(4, 8, 8);  transpose_4 = None

        # File: hstu.py:39 in forward, code: gated = u * F.layer_norm(out, (H * dv,), eps=1e-6)
        layer_norm_1: "f32[4, 8, 8]" = torch.nn.functional.layer_norm(out, (8,), eps = 1e-06);  out = None
        gated: "f32[4, 8, 8]" = u * layer_norm_1;  u = layer_norm_1 = None

        # File: hstu.py:40 in forward, code: return x + self.output(self.dropout(gated))
        dropout_1: "f32[4, 8, 8]" = torch.nn.functional.dropout(gated, 0.0, True, False);  gated = None
        linear_1: "f32[4, 8, 8]" = torch._C._nn.linear(dropout_1, l_self_modules_blocks_modules_0_modules_output_parameters_weight_, l_self_modules_blocks_modules_0_modules_output_parameters_bias_);  dropout_1 = l_self_modules_blocks_modules_0_modules_output_parameters_weight_ = l_self_modules_blocks_modules_0_modules_output_parameters_bias_ = None
        x_4: "f32[4, 8, 8]" = x_3 + linear_1;  x_3 = linear_1 = None

        # File: common.py:62 in forward, code: return F.normalize(x, dim=-1) * valid.unsqueeze(-1)
        normalize: "f32[4, 8, 8]" = torch.nn.functional.normalize(x_4, dim = -1);  x_4 = None
        unsqueeze_12: "b8[4, 8, 1]" = valid.unsqueeze(-1);  valid = None
        mul_4: "f32[4, 8, 8]" = normalize * unsqueeze_12;  normalize = unsqueeze_12 = None
        return (mul_4,)

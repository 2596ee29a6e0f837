# grcompile graph 0: jagged_rewrite
# after pass 4/5 'jagged_rewrite'
# 6 rewrite(s); nodes 63 -> 84
# counters: jagged_rewrite.embedding=1, jagged_rewrite.exit_dense=1, jagged_rewrite.jagged_attention=1, jagged_rewrite.layer_norm=2, jagged_rewrite.linear=2
#   embedding at common.py:55 in forward
#   layer_norm at hstu.py:27 in forward
#   linear at hstu.py:28 in forward
#   jagged_attention at hstu.py:37 in forward
#   layer_norm at hstu.py:39 in forward
#   linear at hstu.py:40 in forward
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

        # No stacktrace found for following nodes
        pack_index_default = torch.ops.grcompile.pack_index.default(valid)
        mod = pack_index_default % 8
        valid_to_offsets = grcompile_lowering_jagged_valid_to_offsets(valid)
        flatten = l_ids_.flatten(0, 1)
        getitem_10 = flatten[pack_index_default];  flatten = None

        # File: common.py:54 in forward, code: positions = torch.arange(N, device=ids.device)
        positions: "i64[8]" = torch.arange(8, device = device(type='cpu'))

        # File: common.py:55 in forward, code: x = self.item_embedding(ids)
        check_index_default: "i64[4, 8]" = torch.ops.grcompile.check_index.default(l_ids_, 0, 21, "of item_embedding (21 rows) in input 'ids', looked up at common.py:55 in forward");  l_ids_ = check_index_default = None
        embedding_2 = torch.nn.functional.embedding(getitem_10, l_self_modules_item_embedding_parameters_weight_, 0, None, 2.0, False, False);  getitem_10 = l_self_modules_item_embedding_parameters_weight_ = None

        # File: common.py:58 in forward, code: x = x * math.sqrt(self.config.embedding_dim)
        mul_5 = embedding_2 * 2.8284271247461903;  embedding_2 = None

        # File: common.py:59 in forward, code: x = x + self.position_embedding(positions).unsqueeze(0)
        embedding_1: "f32[8, 8]" = torch.nn.functional.embedding(positions, l_self_modules_position_embedding_parameters_weight_, None, None, 2.0, False, False);  positions = l_self_modules_position_embedding_parameters_weight_ = None
        unsqueeze: "f32[1, 8, 8]" = embedding_1.unsqueeze(0);  embedding_1 = None

        # No stacktrace found for following nodes
        permute_4 = unsqueeze.permute(1, 0, 2);  unsqueeze = None
        getitem_11 = permute_4[mod];  permute_4 = None
        squeeze = getitem_11.squeeze(1);  getitem_11 = None

        # File: common.py:59 in forward, code: x = x + self.position_embedding(positions).unsqueeze(0)
        add_5 = mul_5 + squeeze;  mul_5 = squeeze = None

        # File: common.py:60 in forward, code: x = self.input_dropout(x) * valid.unsqueeze(-1)
        dropout_2 = torch.nn.functional.dropout(add_5, 0.0, True, False);  add_5 = None
        unsqueeze_1: "b8[4, 8, 1]" = valid.unsqueeze(-1)

        # No stacktrace found for following nodes
        flatten_1 = unsqueeze_1.flatten(0, 1);  unsqueeze_1 = None
        getitem_12 = flatten_1[pack_index_default];  flatten_1 = None

        # File: common.py:60 in forward, code: x = self.input_dropout(x) * valid.unsqueeze(-1)
        mul_6 = dropout_2 * getitem_12;  dropout_2 = getitem_12 = None

        # File: hstu.py:27 in forward, code: normed = F.layer_norm(x, (D,), eps=1e-6)
        layer_norm_2 = torch.nn.functional.layer_norm(mul_6, (8,), eps = 1e-06)

        # File: hstu.py:28 in forward, code: u, v, q, k = torch.split(F.silu(self.uvqk(normed)), [H * dv, H * dv, H * dqk, H * dqk], dim=-1)
        linear_2 = torch._C._nn.linear(layer_norm_2, l_self_modules_blocks_modules_0_modules_uvqk_parameters_weight_, None);  layer_norm_2 = l_self_modules_blocks_modules_0_modules_uvqk_parameters_weight_ = None
        silu_2 = torch.nn.functional.silu(linear_2);  linear_2 = None
        split_1 = torch.functional.split(silu_2, [8, 8, 8, 8], dim = 1);  silu_2 = None
        getitem_13 = split_1[0]
        getitem_14 = split_1[1]
        getitem_15 = split_1[2]
        getitem_16 = split_1[3];  split_1 = None

        # File: hstu.py:29 in forward, code: q = q.view(B, N, H, dqk).transpose(1, 2)
        reshape_1 = getitem_15.reshape(-1, 2, 4);  getitem_15 = None
        permute_5 = reshape_1.permute(0, 1, 2);  reshape_1 = None

        # File: hstu.py:30 in forward, code: k = k.view(B, N, H, dqk).transpose(1, 2)
        reshape_2 = getitem_16.reshape(-1, 2, 4);  getitem_16 = None
        permute_6 = reshape_2.permute(0, 1, 2);  reshape_2 = None

        # File: hstu.py:31 in forward, code: v = v.view(B, N, H, dv).transpose(1, 2)
        reshape_3 = getitem_14.reshape(-1, 2, 4);  getitem_14 = None
        permute_7 = reshape_3.permute(0, 1, 2);  reshape_3 = None

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

        # File: hstu.py:34 in forward, code: scores = torch.matmul(q, k.transpose(-2, -1)) + rab.unsqueeze(1)
        permute_8 = permute_6.permute(0, 1, 2);  permute_6 = None

        # No stacktrace found for following nodes
        permute_9 = permute_5.permute(0, 1, 2);  permute_5 = None
        permute_10 = permute_8.permute(0, 1, 2);  permute_8 = None
        permute_11 = permute_7.permute(0, 1, 2);  permute_7 = None
        expand_as: "i64[4, 8]" = query_ts.expand_as(valid);  query_ts = None
        flatten_2 = expand_as.flatten(0, 1);  expand_as = None
        getitem_17 = flatten_2[pack_index_default];  flatten_2 = None
        expand_as_1: "b8[4, 8]" = valid.expand_as(valid)
        flatten_3 = expand_as_1.flatten(0, 1);  expand_as_1 = None
        getitem_18 = flatten_3[pack_index_default];  flatten_3 = None
        expand_as_2: "i64[4, 8]" = l_timestamps_.expand_as(valid);  l_timestamps_ = None
        flatten_4 = expand_as_2.flatten(0, 1);  expand_as_2 = None
        getitem_19 = flatten_4[pack_index_default];  flatten_4 = None
        expand_as_3: "b8[4, 8]" = valid.expand_as(valid)
        flatten_5 = expand_as_3.flatten(0, 1);  expand_as_3 = None
        getitem_20 = flatten_5[pack_index_default];  flatten_5 = None

        # File: hstu.py:37 in forward, code: out = torch.matmul(attn, v).transpose(1, 2).reshape(B, N, H * dv)
        jagged_attention_default = torch.ops.grcompile.jagged_attention.default(permute_9, permute_10, permute_11, valid_to_offsets, mod, [getitem_17, getitem_18], [getitem_19, getitem_20], [l_self_modules_blocks_modules_0_modules_position_bias_parameters_weight_, l_self_modules_blocks_modules_0_modules_time_bias_parameters_weight_], None, score_mod = 'captured-0071706ec5bf', use_qk = True, activation = 'identity', scale = 1.0, out_scale = 1.0, causal = True, max_len = 8, dropout_p = 0.0);  permute_9 = permute_10 = permute_11 = valid_to_offsets = mod = getitem_17 = getitem_18 = getitem_19 = getitem_20 = l_self_modules_blocks_modules_0_modules_position_bias_parameters_weight_ = l_self_modules_blocks_modules_0_modules_time_bias_parameters_weight_ = None

        # No stacktrace found for following nodes
        permute_12 = jagged_attention_default.permute(0, 1, 2);  jagged_attention_default = None

        # File: hstu.py:37 in forward, code: out = torch.matmul(attn, v).transpose(1, 2).reshape(B, N, H * dv)
        permute_13 = permute_12.permute(0, 1, 2);  permute_12 = None
        reshape_4 = permute_13.reshape(-1, 8);  permute_13 = None

        # File: hstu.py:39 in forward, code: gated = u * F.layer_norm(out, (H * dv,), eps=1e-6)
        layer_norm_3 = torch.nn.functional.layer_norm(reshape_4, (8,), eps = 1e-06);  reshape_4 = None
        mul_7 = getitem_13 * layer_norm_3;  getitem_13 = layer_norm_3 = None

        # File: hstu.py:40 in forward, code: return x + self.output(self.dropout(gated))
        dropout_3 = torch.nn.functional.dropout(mul_7, 0.0, True, False);  mul_7 = None
        linear_3 = torch._C._nn.linear(dropout_3, l_self_modules_blocks_modules_0_modules_output_parameters_weight_, l_self_modules_blocks_modules_0_modules_output_parameters_bias_);  dropout_3 = l_self_modules_blocks_modules_0_modules_output_parameters_weight_ = l_self_modules_blocks_modules_0_modules_output_parameters_bias_ = None
        add_6 = mul_6 + linear_3;  mul_6 = linear_3 = None

        # File: common.py:62 in forward, code: return F.normalize(x, dim=-1) * valid.unsqueeze(-1)
        normalize_1 = torch.nn.functional.normalize(add_6, dim = 1);  add_6 = None
        unsqueeze_12: "b8[4, 8, 1]" = valid.unsqueeze(-1);  valid = None

        # No stacktrace found for following nodes
        flatten_6 = unsqueeze_12.flatten(0, 1);  unsqueeze_12 = None
        getitem_21 = flatten_6[pack_index_default];  flatten_6 = None

        # File: common.py:62 in forward, code: return F.normalize(x, dim=-1) * valid.unsqueeze(-1)
        mul_8 = normalize_1 * getitem_21;  normalize_1 = getitem_21 = None

        # No stacktrace found for following nodes
        jagged_to_dense = grcompile_lowering_jagged_jagged_to_dense(mul_8, pack_index_default, 4, 8);  mul_8 = pack_index_default = None
        return (jagged_to_dense,)

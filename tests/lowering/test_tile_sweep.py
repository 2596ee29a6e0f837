"""The tile sweep's choice rule (``python -m grcompile.lowering.tile_sweep``), on made-up compile
results: no compiling here (the real sweep takes about an hour per arch on two cores)."""
from __future__ import annotations

from grcompile.lowering import tile_sweep as ts


class FakeSweep(ts.Sweep):
    """``fake(tile, model) -> (registers, spill bytes, MMA level)`` stands for the compile."""

    def __init__(self, kernel, arch, bucket, fake):
        super().__init__(kernel, arch, bucket)
        self.fake, self.calls = fake, []

    def compile(self, tile, model):
        done = self.results.setdefault(tile, {})
        if model not in done:
            self.calls.append((tile, model))
            regs, spill, level = self.fake(tile, model)
            done[model] = {"registers": regs, "spill_bytes": spill, "shared_bytes": 0, "mma": [], "hard": [],
                           "mma_level": level, "passes": spill == 0 and level == 0, "seconds": 0.0}
        return done[model]


def test_largest_passing_tile_then_fewest_registers():
    def fake(tile, model):
        bm, bn, warps, stages = tile
        return 200 - bm, 0 if bm * bn <= 2048 and warps == 8 else 96, 0
    sweep = FakeSweep("fwd", "sm_80", 64, fake)
    r = sweep.run()
    assert tuple(r["tile"]) == (128, 16, 8, 3) and not r["spills"] and r["mma_level"] == 0
    assert sorted(map(tuple, r["passing_same_size"])) == sorted(
        (bm, bn, 8, s) for bm, bn in ((16, 128), (32, 64), (64, 32), (128, 16)) for s in (1, 2, 3))
    assert set(sweep.models) == {"hstu", "time_bucket_per_head", "fuxi_positional", "sasrec"}
    # a failing tile stops at its first score_mod; smaller sizes than the winner are never compiled
    assert all(len(res) == 1 for t, res in sweep.results.items() if t[0] * t[1] > 2048 or t[2] == 4)
    assert all(t[0] * t[1] >= 2048 for t in sweep.results)


def test_a_pipelined_tile_beats_one_stage_with_fewer_registers():
    def fake(tile, model):  # only 64 x 64 passes; one stage needs the fewest registers
        bm, bn, warps, stages = tile
        return {1: 150, 2: 200, 3: 190}[stages], 0 if (bm, bn, warps) == (64, 64, 8) else 96, 0
    r = FakeSweep("fwd", "sm_90", 64, fake).run()
    assert tuple(r["tile"]) == (64, 64, 8, 3)  # of the pipelined ones, the fewer registers

    def mixed(tile, model):  # nothing passes (mma.sync beside wgmma everywhere): the same preference
        return {1: 150, 2: 200, 3: 190}[tile[3]], 0 if tile[:3] == (64, 64, 8) else 96, 1
    r = FakeSweep("bwd_kv", "sm_90", 64, mixed).run()
    assert tuple(r["tile"]) == (64, 64, 8, 3) and r["mma_level"] == 1


def test_a_pipelined_tile_one_size_down_beats_a_one_stage_tile():
    def fake(tile, model):  # one stage passes at 4096 per program, pipelined tiles from 2048 down
        bm, bn, warps, stages = tile
        area = bm * bn
        passes = warps == 8 and (area <= 2048 or (area == 4096 and stages == 1))
        return 100 + stages, 0 if passes else 96, 0
    sweep = FakeSweep("fwd", "sm_80", 128, fake)
    r = sweep.run()
    assert r["tile"][0] * r["tile"][1] == 2048 and r["tile"][3] == 2
    assert all(t[0] * t[1] >= 2048 for t in sweep.results)  # no further than one size down

    def only_one_stage(tile, model):  # nothing pipelined passes one size down: the larger one-stage tile
        bm, bn, warps, stages = tile
        return 100, 0 if warps == 8 and stages == 1 and bm * bn <= 4096 else 96, 0
    r = FakeSweep("fwd", "sm_80", 128, only_one_stage).run()
    assert r["tile"][0] * r["tile"][1] == 4096 and r["tile"][3] == 1

    def mixed(tile, model):  # nothing passes (mma.sync beside wgmma): the same one-size-down preference
        bm, bn, warps, stages = tile
        area = bm * bn
        return 100, 0 if warps == 8 and (area <= 1024 or (area == 2048 and stages == 1)) else 96, 1
    r = FakeSweep("bwd_kv", "sm_90", 128, mixed).run()
    assert r["tile"][0] * r["tile"][1] == 1024 and r["tile"][3] >= 2 and r["mma_level"] == 1


def test_no_spill_free_wgmma_tile_at_256_takes_a_spill_free_mma_sync_one():
    def fake(tile, model):  # sm_90: BLOCK_M < 64 is mma.sync alone (level 2), BLOCK_M >= 64 spills
        bm, bn, _, _ = tile
        return 250 - bn, (100 if bm >= 64 else 0), (0 if bm >= 64 else 2)
    sweep = FakeSweep("bwd_q", "sm_90", 256, fake)
    r = sweep.run()
    bm, bn, _, _ = r["tile"]
    assert bm < 64 and bm * bn == ts.MAX_AREA[256] and bn == 128 and r["mma_level"] == 2 and not r["spills"]
    assert all(t[0] * t[1] <= ts.MAX_AREA[256] for t in sweep.results)  # larger tiles are not tried at 256


def test_wgmma_with_the_least_spill_beats_mma_sync_when_the_plain_kernel_fits():
    def fake(tile, model):  # BLOCK_M >= 64: wgmma, the plain kernel fits, score_mods spill by tile size
        bm, bn, _, _ = tile
        if bm < 64:
            return 200, 0, 2
        return 255, (0 if model == ts.PLAIN else bm * bn // 64), 0
    r = FakeSweep("fwd", "sm_90", 128, fake).run()
    assert r["tile"][:2] == [64, 16] and r["spills"] and r["mma_level"] == 0
    assert r["per_model"][ts.PLAIN]["spill_bytes"] == 0 and r["per_model"]["hstu"]["spill_bytes"] == 16

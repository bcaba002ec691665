"""The GPU proxy: bench.hlo_traffic's HBM-traffic model on small hand-written HLO modules (every byte count
below is worked out by hand from the model's rules), and bench.gpu_proxy end to end on the LM head when the
CUDA plugin wheels are installed (the gpu-proxy extra)."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from bench import gpu_proxy
from bench import hlo_traffic as ht

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_of(text: str, **kw) -> ht.Model:
    return ht.Model(ht.parse_module(text), **kw)


# ------------------------------------------------------------------------------------------- shapes


def test_shape_bytes_and_tuples():
    assert ht.shape_bytes("f32[2,3]{1,0}") == 24
    assert ht.shape_bytes("pred[]") == 1
    assert ht.shape_bytes("(bf16[4]{0}, /*index=1*/s32[], (u8[3], f64[2]))") == 8 + 4 + 3 + 16
    assert ht.tuple_elements("(bf16[4]{0}, (u8[3], f64[2]), s32[])") == ["bf16[4]{0}", "(u8[3], f64[2])", "s32[]"]
    assert ht.array_dims("(f32[2,1,3]{2,1,0}, s8[16])") == [("f32", (2, 1, 3)), ("s8", (16,))]
    # a GEMM's result without its s8 workspace
    assert ht.result_bytes("(f32[8,8]{1,0}, s8[1024]{0})") == 256


def test_parse_instruction_line():
    line = ('  ROOT %fusion.3 = (f32[4]{0}, /*index=1*/s32[]) fusion(%p.1, %get-tuple-element.2), kind=kLoop, '
            'calls=%fused_computation.3, metadata={op_name="jit(f)/add"}, backend_config={"x":1}')
    ins = ht.parse_instr(line)
    assert (ins.name, ins.opcode, ins.root) == ("fusion.3", "fusion", True)
    assert ins.operands == ("p.1", "get-tuple-element.2")
    assert ins.called == ("fused_computation.3",)
    assert ht.shape_bytes(ins.shape) == 20
    w = ht.parse_instr('  %while.1 = (s32[], f32[4]{0}) while(%tuple), condition=%cond, body=%body, '
                       'backend_config={"known_trip_count":{"n":"7"},"known_init_step":{"init":"0"}}')
    assert (w.body, w.condition, w.trip_count) == ("body", "cond", 7)
    assert ht.parse_instr("HloModule m, entry_computation_layout={()->f32[]}") is None


# ------------------------------------------------------------------------------------------- kernels

ELEMENTWISE = """HloModule m

%fused_add (a: f32[1024], b: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %b = f32[1024]{0} parameter(1)
  ROOT %add = f32[1024]{0} add(%a, %b)
}

ENTRY %main (x: f32[1024], y: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %y = f32[1024]{0} parameter(1)
  ROOT %fusion = f32[1024]{0} fusion(%x, %y), kind=kLoop, calls=%fused_add
}
"""


def test_a_kernel_reads_its_operands_and_writes_its_result_once():
    t = model_of(ELEMENTWISE).run()
    assert t.bytes == 3 * 4096  # two 4 KiB operands read, one 4 KiB result written
    assert (t.kernels, t.host_syncs, t.weight_copies) == (1, 0, 0)


SLICES = """HloModule m

%fused_slice (p: f32[8,256], i: s32[]) -> f32[1,256] {
  %p = f32[8,256]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,256]{1,0} dynamic-slice(%p, %i, %z), dynamic_slice_sizes={1,256}
}

%fused_update (base: f32[8,256], u: f32[1,256], i: s32[]) -> f32[8,256] {
  %base = f32[8,256]{1,0} parameter(0)
  %u = f32[1,256]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %two = f32[1,256]{1,0} add(%u, %u)
  ROOT %dus = f32[8,256]{1,0} dynamic-update-slice(%base, %two, %i, %z)
}

%fused_gather (table: f32[1000,64], ids: s32[4,1]) -> f32[4,64] {
  %table = f32[1000,64]{1,0} parameter(0)
  %ids = s32[4,1]{1,0} parameter(1)
  %bc = f32[1000,64]{1,0} bitcast(%table)
  ROOT %g = f32[4,64]{1,0} gather(%bc, %ids), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}
}

ENTRY %main (w: f32[8,256], i: s32[], table: f32[1000,64], ids: s32[4,1]) -> (f32[1,256], f32[8,256], f32[4,64]) {
  %w = f32[8,256]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %table = f32[1000,64]{1,0} parameter(2)
  %ids = s32[4,1]{1,0} parameter(3)
  %slice = f32[1,256]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %upd = f32[8,256]{1,0} fusion(%w, %slice, %i), kind=kLoop, calls=%fused_update
  %rows = f32[4,64]{1,0} fusion(%table, %ids), kind=kLoop, calls=%fused_gather
  ROOT %t = (f32[1,256]{1,0}, f32[8,256]{1,0}, f32[4,64]{1,0}) tuple(%slice, %upd, %rows)
}
"""


def test_slices_read_their_elements_and_updates_are_in_place():
    t = model_of(SLICES).run()
    slice_ = 1024 + 4 + 1024  # the 1 KiB row read (not the 8 KiB array), the index, the row written
    update = 0 + 1024 + 4 + 1024  # base untouched, update read, index, only the update written
    gather = 4 * 64 * 4 + 16 + 4 * 64 * 4  # four 256 B rows of the 256 KB table, the ids, the rows written
    assert t.by_kernel == {"fusion:slice": slice_, "fusion:upd": update, "fusion:rows": gather}
    assert t.bytes == slice_ + update + gather and t.kernels == 3


NESTED = """HloModule m

%operand (q: f32[8,256], i: s32[]) -> f32[1,256] {
  %q = f32[8,256]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,256]{1,0} dynamic-slice(%q, %i, %z), dynamic_slice_sizes={1,256}
}

%gemm (p: f32[8,256], i: s32[], x: f32[256,16]) -> f32[1,16] {
  %p = f32[8,256]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[256,16]{1,0} parameter(2)
  %row = f32[1,256]{1,0} fusion(%p, %i), kind=kLoop, calls=%operand
  ROOT %d = f32[1,16]{1,0} dot(%row, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: f32[8,256], i: s32[], x: f32[256,16]) -> f32[1,16] {
  %w = f32[8,256]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[256,16]{1,0} parameter(2)
  ROOT %f = f32[1,16]{1,0} fusion(%w, %i, %x), kind=kCustom, calls=%gemm
}
"""


def test_a_nested_fusion_that_slices_a_parameter_reads_the_slice():
    # a GEMM whose operand fusion takes one row of w: the row (1 KiB of 8), the index, x whole, the result
    assert model_of(NESTED).run().bytes == 1024 + 4 + 256 * 16 * 4 + 16 * 4


UNFUSED = """HloModule m

ENTRY %main (a: f32[64,64], b: f32[64,64], big: bf16[4,1024], u: bf16[1,1024], i: s32[]) -> (f32[64,64], bf16[4,1024], bf16[4,1024]) {
  %a = f32[64,64]{1,0} parameter(0)
  %b = f32[64,64]{1,0} parameter(1)
  %big = bf16[4,1024]{1,0} parameter(2)
  %u = bf16[1,1024]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %z = s32[] constant(0)
  %gemm = (f32[64,64]{1,0}, s8[4096]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"
  %out = f32[64,64]{1,0} get-tuple-element(%gemm), index=0
  %dus = bf16[4,1024]{1,0} dynamic-update-slice(%big, %u, %i, %z)
  %cs = (bf16[4,1024]{1,0}, bf16[4,1024]{1,0}, u32[]) copy-start(%big)
  %cd = bf16[4,1024]{1,0} copy-done(%cs)
  ROOT %t = (f32[64,64]{1,0}, bf16[4,1024]{1,0}, bf16[4,1024]{1,0}) tuple(%out, %dus, %cd)
}
"""


def test_unfused_ops_gemm_workspace_and_async_copies():
    t = model_of(UNFUSED).run()
    assert t.by_kernel["custom-call:gemm"] == 3 * 64 * 64 * 4  # A and B read, C written; no workspace
    assert t.by_kernel["dynamic-update-slice:dus"] == 2 * 2048 + 8  # the 2 KiB update read and written, 2 indices
    assert t.by_kernel["copy-start:cs"] == 2 * 8192  # an async copy reads and writes its 8 KiB operand
    assert t.kernels == 3  # the -done halves launch nothing


# ------------------------------------------------------------------------------------------- control flow

LOOPS = """HloModule m

%fused_scale (p: f32[256]) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  ROOT %m = f32[256]{0} multiply(%p, %p)
}

%body_known (c: (s32[], f32[256])) -> (s32[], f32[256]) {
  %c = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %x = f32[256]{0} get-tuple-element(%c), index=1
  %y = f32[256]{0} fusion(%x), kind=kLoop, calls=%fused_scale
  ROOT %r = (s32[], f32[256]{0}) tuple(%i, %y)
}

%cond_known (c: (s32[], f32[256])) -> pred[] {
  %c = (s32[], f32[256]{0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

%body_open (c: (s32[], f32[256])) -> (s32[], f32[256]) {
  %c = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %x = f32[256]{0} get-tuple-element(%c), index=1
  %y = f32[256]{0} fusion(%x), kind=kLoop, calls=%fused_scale
  %inner = (s32[], f32[256]{0}) while(%c), condition=%cond_known, body=%body_known, backend_config={"known_trip_count":{"n":"3"}}
  %z = f32[256]{0} get-tuple-element(%inner), index=1
  %two = f32[256]{0} fusion(%z), kind=kLoop, calls=%fused_scale
  ROOT %r = (s32[], f32[256]{0}) tuple(%i, %two)
}

%cond_open (c: (s32[], f32[256])) -> pred[] {
  %c = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%cheap (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  ROOT %y = f32[256]{0} fusion(%x), kind=kLoop, calls=%fused_scale
}

%dear (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  %y = f32[256]{0} fusion(%x), kind=kLoop, calls=%fused_scale
  ROOT %z = f32[256]{0} fusion(%y), kind=kLoop, calls=%fused_scale
}

ENTRY %main (x: f32[256], p: pred[]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  %p = pred[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256]{0}) tuple(%zero, %x)
  %loop = (s32[], f32[256]{0}) while(%init), condition=%cond_open, body=%body_open
  %y = f32[256]{0} get-tuple-element(%loop), index=1
  ROOT %branch = f32[256]{0} conditional(%p, %y, %y), true_computation=%dear, false_computation=%cheap
}
"""
K = 2 * 1024  # one fused_scale kernel: 1 KiB read, 1 KiB written
COMPARE = 4 + 4 + 1  # the loop condition's compare: two s32 operands read (a constant too), a pred written


def test_loops_count_times_their_trip_and_unknown_trips_sync():
    m = model_of(LOOPS)
    per_iteration = K + 3 * K + K + COMPARE  # the body's two kernels, the inner loop x 3, the condition
    t = m.run()
    assert t.bytes == per_iteration + 2 * K  # one assumed iteration, then the costlier branch (two kernels)
    assert t.kernels == 1 + 3 + 1 + 1 + 2
    assert t.host_syncs == 1 + 1  # the loop without a trip count (one iteration), the conditional
    m4 = model_of(LOOPS, unknown_trips=4)
    assert m4.run().bytes == 4 * per_iteration + 2 * K and m4.run().host_syncs == 4 + 1
    assert m4.per_iteration("loop").bytes == per_iteration and m4.per_iteration("loop").host_syncs == 1
    assert m4.without("loop").bytes == 2 * K and m4.without("loop").host_syncs == 1
    loops = {lp.name: lp for lp in m4.loops()}
    assert (loops["loop"].trip_count, loops["loop"].depth, loops["loop"].in_unknown_loop) == (None, 0, False)
    assert (loops["inner"].trip_count, loops["inner"].runs, loops["inner"].depth) == (3, 4, 1)
    assert loops["inner"].in_unknown_loop


def test_cheap_loops_take_the_cheapest_branch():
    wrapped = LOOPS.replace("ENTRY %main (x: f32[256], p: pred[]) -> f32[256] {", """%outer_cond (c: (f32[256], pred[])) -> pred[] {
  %c = (f32[256]{0}, pred[]) parameter(0)
  ROOT %p = pred[] get-tuple-element(%c), index=1
}

%outer_body (c: (f32[256], pred[])) -> (f32[256], pred[]) {
  %c = (f32[256]{0}, pred[]) parameter(0)
  %x = f32[256]{0} get-tuple-element(%c), index=0
  %p = pred[] get-tuple-element(%c), index=1
  %b = f32[256]{0} conditional(%p, %x, %x), true_computation=%dear, false_computation=%cheap
  ROOT %r = (f32[256]{0}, pred[]) tuple(%b, %p)
}

ENTRY %main (x: f32[256], p: pred[]) -> f32[256] {""").replace(
        "  ROOT %branch = f32[256]{0} conditional(%p, %y, %y), true_computation=%dear, false_computation=%cheap",
        "  %t0 = (f32[256]{0}, pred[]) tuple(%y, %p)\n"
        "  %steps = (f32[256]{0}, pred[]) while(%t0), condition=%outer_cond, body=%outer_body\n"
        "  ROOT %out = f32[256]{0} get-tuple-element(%steps), index=0")
    m = model_of(wrapped)
    assert m.per_iteration("steps").bytes == 2 * K and m.per_iteration("steps").host_syncs == 2
    m.cheap_loops.add("steps")
    assert m.per_iteration("steps").bytes == K and m.per_iteration("steps").host_syncs == 2


# ------------------------------------------------------------------------------- slice offsets on the host

DSF = '"fusion_backend_config":{"custom_fusion_config":{"kernel_index":0,"name":"dynamic_slice_fusion"}}'
SLICE_OFFSETS = """HloModule m

%gemm_on_slice (w: bf16[4,64,64], i: s32[], h: bf16[8,64]) -> bf16[8,64] {
  %w = bf16[4,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %h = bf16[8,64]{1,0} parameter(2)
  %z = s32[] constant(0)
  %ds = bf16[1,64,64]{2,1,0} dynamic-slice(%w, %i, %z, %z), dynamic_slice_sizes={1,64,64}
  %bc = bf16[64,64]{1,0} bitcast(%ds)
  ROOT %g = bf16[8,64]{1,0} custom-call(%h, %bc), custom_call_target="__cublas$gemm"
}

%fused_plus_one (i: s32[]) -> s32[] {
  %i = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %n = s32[] add(%i, %one)
}

%gemm_on_next_slice (w: bf16[4,64,64], i: s32[], h: bf16[8,64]) -> bf16[8,64] {
  %w = bf16[4,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %h = bf16[8,64]{1,0} parameter(2)
  %z = s32[] constant(0)
  %n = s32[] fusion(%i), kind=kLoop, calls=%fused_plus_one
  %ds = bf16[1,64,64]{2,1,0} dynamic-slice(%w, %n, %z, %z), dynamic_slice_sizes={1,64,64}
  %bc = bf16[64,64]{1,0} bitcast(%ds)
  ROOT %g = bf16[8,64]{1,0} custom-call(%h, %bc), custom_call_target="__cublas$gemm"
}

%wrapped (w: bf16[4,64,64], i: s32[], h: bf16[8,64]) -> bf16[8,64] {
  %w = bf16[4,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %h = bf16[8,64]{1,0} parameter(2)
  ROOT %f = bf16[8,64]{1,0} fusion(%w, %i, %h), kind=kCustom, calls=%gemm_on_slice, backend_config={DSF}
}

%cond (c: (s32[], s32[], bf16[4,64,64], bf16[8,64])) -> pred[] {
  %c = (s32[], s32[], bf16[4,64,64]{2,1,0}, bf16[8,64]{1,0}) parameter(0)
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%c#0, %four), direction=LT
}

%body (c: (s32[], s32[], bf16[4,64,64], bf16[8,64])) -> (s32[], s32[], bf16[4,64,64], bf16[8,64]) {
  %c = (s32[], s32[], bf16[4,64,64]{2,1,0}, bf16[8,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %j = s32[] get-tuple-element(%c), index=1
  %w = bf16[4,64,64]{2,1,0} get-tuple-element(%c), index=2
  %h = bf16[8,64]{1,0} get-tuple-element(%c), index=3
  %next = s32[] fusion(%i), kind=kLoop, calls=%fused_plus_one
  %by_step = bf16[8,64]{1,0} fusion(%w, %next, %h), kind=kCustom, calls=%gemm_on_slice, backend_config={DSF}
  %by_value = bf16[8,64]{1,0} fusion(%w, %j, %by_step), kind=kCustom, calls=%gemm_on_slice, backend_config={DSF}
  %inside_step = bf16[8,64]{1,0} fusion(%w, %i, %by_value), kind=kCustom, calls=%gemm_on_next_slice, backend_config={DSF}
  %inside_value = bf16[8,64]{1,0} fusion(%w, %j, %inside_step), kind=kCustom, calls=%gemm_on_next_slice, backend_config={DSF}
  %start = ((bf16[4,64,64]{2,1,0}, s32[], bf16[8,64]{1,0}), bf16[8,64]{1,0}, u32[]) async-start(%c#2, %c#1, %inside_value), calls=%wrapped
  %done = bf16[8,64]{1,0} async-done(%start)
  ROOT %r = (s32[], s32[], bf16[4,64,64]{2,1,0}, bf16[8,64]{1,0}) tuple(%next, %j, %w, %done)
}

%branch (t: (s32[], bf16[4,64,64], bf16[8,64])) -> bf16[8,64] {
  %t = (s32[], bf16[4,64,64]{2,1,0}, bf16[8,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = bf16[4,64,64]{2,1,0} get-tuple-element(%t), index=1
  %h = bf16[8,64]{1,0} get-tuple-element(%t), index=2
  ROOT %f = bf16[8,64]{1,0} fusion(%w, %i, %h), kind=kCustom, calls=%gemm_on_slice, backend_config={DSF}
}

ENTRY %main (w: bf16[4,64,64], j: s32[], h: bf16[8,64], p: pred[]) -> bf16[8,64] {
  %w = bf16[4,64,64]{2,1,0} parameter(0)
  %j = s32[] parameter(1)
  %h = bf16[8,64]{1,0} parameter(2)
  %p = pred[] parameter(3)
  %z = s32[] constant(0)
  %two = s32[] constant(2)
  %t = (s32[], s32[], bf16[4,64,64]{2,1,0}, bf16[8,64]{1,0}) tuple(%z, %j, %w, %h)
  %loop = (s32[], s32[], bf16[4,64,64]{2,1,0}, bf16[8,64]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"},"known_init_step":{"init":"0","step":"1"},"known_induction_variable":{"tuple_index":"0"}}
  %once = bf16[8,64]{1,0} fusion(%w, %z, %h), kind=kCustom, calls=%gemm_on_slice, backend_config={DSF}
  %shared = ((bf16[4,64,64]{2,1,0}, s32[], bf16[8,64]{1,0}), bf16[8,64]{1,0}, u32[]) async-start(%w, %two, %once), calls=%wrapped
  %shared_done = bf16[8,64]{1,0} async-done(%shared), calls=%wrapped
  %by_device = (s32[], bf16[4,64,64]{2,1,0}, bf16[8,64]{1,0}) tuple(%j, %w, %shared_done)
  %by_constant = (s32[], bf16[4,64,64]{2,1,0}, bf16[8,64]{1,0}) tuple(%two, %w, %shared_done)
  %pick = bf16[8,64]{1,0} conditional(%p, %by_device, %by_constant), true_computation=%branch, false_computation=%branch
  ROOT %last = bf16[8,64]{1,0} get-tuple-element(%loop), index=3
}
""".replace("{DSF}", "{" + DSF + "}")


def test_slice_offsets_read_from_the_device_cost_a_host_sync():
    """A dynamic-slice fusion (a GEMM reading a weight slice in place) whose offset is a function of the loop's
    induction variable (or a constant), also when computed inside the fusion, runs from host-known offsets;
    one whose offset is a value the device carries (``%j``, ``%c#1``) makes XLA:GPU copy it to the host and
    wait, at each of the loop's 4 iterations, also inside an async computation (shared with a start whose
    offset is a constant) or a conditional's branch (bound to its caller's operand)."""
    m = model_of(SLICE_OFFSETS)
    body = m.module.instr("body")
    assert body["start"].elements == (2, 1, None) and body["by_value"].slice_fusion
    assert m.module.instr("main")["loop"].induction == 0
    assert m.offsets_on_host("body", body["by_step"])  # (the induction variable plus one)
    assert m.offsets_on_host("body", body["inside_step"])  # (plus one inside the fusion)
    assert not m.offsets_on_host("body", body["by_value"])
    assert not m.offsets_on_host("body", body["inside_value"])
    assert m.offsets_on_host("main", m.module.instr("main")["once"])  # a constant
    f = m.module.instr("branch")["f"]
    assert not m.offsets_on_host("branch", f, ("main", "pick", 1, None))  # the true branch: %j
    assert m.offsets_on_host("branch", f, ("main", "pick", 2, None))  # the false branch: a constant
    t = m.run()
    # by_value, inside_value and the async one per iteration (the loop's trip is known), nothing for the
    # shared async start with a constant offset; the conditional and its costlier (first) branch's %j
    assert t.host_syncs == 4 * 3 + 1 + 1
    unknown = model_of(SLICE_OFFSETS.replace(',"known_induction_variable":{"tuple_index":"0"}', ""))
    assert unknown.run().host_syncs == 4 * 5 + 2  # without a known induction variable no offset in the body is


# ------------------------------------------------------------------------------------------- weight copies

COPIES = """HloModule m

%fused_take (w: bf16[2,512,1024], i: s32[]) -> bf16[1,512,1024] {
  %w = bf16[2,512,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,512,1024]{2,1,0} dynamic-slice(%w, %i, %z, %z), dynamic_slice_sizes={1,512,1024}
}

%fused_gemm (h: bf16[512,512], w: bf16[512,1024]) -> bf16[512,1024] {
  %h = bf16[512,512]{1,0} parameter(0)
  %w = bf16[512,1024]{1,0} parameter(1)
  ROOT %d = bf16[512,1024]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: bf16[2,512,1024], i: s32[], h: bf16[512,512]) -> bf16[512,1024] {
  %w = bf16[2,512,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %h = bf16[512,512]{1,0} parameter(2)
  %start = ((bf16[2,512,1024]{2,1,0}, s32[]), bf16[1,512,1024]{2,1,0}, u32[]) fusion-start(%w, %i), kind=kLoop, calls=%fused_take
  %done = bf16[1,512,1024]{2,1,0} fusion-done(%start)
  %slice = bf16[512,1024]{1,0} bitcast(%done)
  ROOT %gemm = bf16[512,1024]{1,0} fusion(%h, %slice), kind=kCustom, calls=%fused_gemm
}
"""


def test_weight_copies_are_weight_shaped_kernels_without_a_matmul():
    m = model_of(COPIES, weight_shapes=[(2, 512, 1024), (512, 1024)])
    t = m.run()
    mib = 512 * 1024 * 2
    assert t.by_kernel["fusion-start:start"] == 4 + 2 * mib  # the async slice reads its 1 MiB, writes a copy
    assert t.by_kernel["fusion:gemm"] == 512 * 512 * 2 + mib + mib  # h, the copied slice, the result
    assert t.weight_copies == 1  # the slice copy; the GEMM writes a weight-shaped result but multiplies
    assert model_of(COPIES).run().weight_copies == 0  # no weight shapes given: nothing counted
    assert model_of(COPIES, weight_shapes=[(512, 1024)], min_copy_bytes=2 * mib).run().weight_copies == 0
    assert m.reads_array(m.module.entry, (512, 1024)) and not m.reads_array(m.module.entry, (7, 7))


# ------------------------------------------------------------------------------------------- the proxy


def test_missing_plugin_is_one_line_and_exit_2(monkeypatch, capsys):
    real = importlib.metadata.version

    def version(dist):
        if dist in gpu_proxy.PLUGIN_DISTS:
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(gpu_proxy, "name_platform", lambda: None)
    assert gpu_proxy.main(["--programs", "lm_head"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "gpu-proxy" in err and "jax-cuda13-plugin" in err


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        gpu_proxy.parse_args(["--programs", "dual_step,nope"])
    with pytest.raises(SystemExit):
        gpu_proxy.parse_args(["--layers", "3"])
    assert gpu_proxy.meta_path("a/b.json") == "a/b.meta.json"
    assert set(gpu_proxy.BLOCK_PROGRAMS) == {f"block_{d}_{m}" for d in ("dual", "polestar")
                                             for m in ("b1", "b32", "running32")}


@pytest.mark.skipif(gpu_proxy.plugin_problem() is not None,
                    reason="the CUDA plugin wheels are not installed (pip install -e '.[gpu-proxy]')")
def test_proxy_compiles_the_lm_head_for_the_h200(tmp_path):
    out, dump = tmp_path / "rows.json", tmp_path / "hlo"
    env = dict(os.environ, JAX_PLATFORMS="cuda")  # the proxy names its platform itself, whatever this says
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_proxy", "--layers", "2", "--programs", "lm_head",
                           "--json", str(out), "--dump", str(dump)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "cuDNN" not in proc.stderr
    (row,) = json.loads(out.read_text())
    assert {"program", "modeled_bytes", "min_bytes", "kernels", "weight_copies", "host_syncs_per_step"} <= set(row)
    assert row["program"] == "lm_head"
    # RMSNorm + one GEMM over the [4096, 126464] bf16 head: the weights read once, as the minimum says
    head = 4096 * 126464 * 2
    assert row["min_bytes"] > head and 1.0 <= row["modeled_bytes"] / row["min_bytes"] < 1.02
    assert row["weight_copies"] == 0 and row["host_syncs_per_step"] == 0
    hlo = (dump / "lm_head.hlo.txt").read_text()
    assert "ENTRY" in hlo and "bf16[4096,126464]" in hlo
    meta = json.loads((tmp_path / "rows.meta.json").read_text())
    assert meta["jax_version"] and meta["command"].startswith("python -m bench.gpu_proxy")


def _proxy_row(tmp_path, program: str, *flags: str) -> dict:
    """The proxy's row of ``program`` at 2 layers (a subprocess, as a user runs it)."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_proxy", "--layers", "2", "--programs", program, *flags,
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    return row


@pytest.mark.skipif(gpu_proxy.plugin_problem() is not None,
                    reason="the CUDA plugin wheels are not installed (pip install -e '.[gpu-proxy]')")
def test_the_dual_cache_block_program_reads_each_weight_once_per_step(tmp_path):
    """The engine's block program for an H200 (the dual cache, batch 1, 2 layers at LLaDA-8B shapes), as the
    engine compiles it: a decode step moves at most 1.2x the bytes it needs, copies no weight and syncs
    with the host at most once."""
    row = _proxy_row(tmp_path, "block_dual_b1", "--attention", "cudnn")  # (cuDNN's attention traces in a step)
    assert row["modeled_bytes"] <= 1.2 * row["min_bytes"], row
    assert row["weight_copies"] == 0 and row["host_syncs_per_step"] <= 1, row


@pytest.mark.skipif(gpu_proxy.plugin_problem() is not None,
                    reason="the CUDA plugin wheels are not installed (pip install -e '.[gpu-proxy]')")
def test_a_batch_of_32_reads_the_kv_cache_once_per_step(tmp_path):
    """The dual cache's block program at batch 32 (2 layers at LLaDA-8B shapes: a 0.27 GB K/V cache per layer)
    writes the block's K/V rows into the cache in place and attends over the cached rotated keys as they
    are: at most 1.9x the minimum (the rest is the logits' second read, the attention scores and the MLP's
    activations of 1024 rows). Copying each layer's cache slice, writing it back and rotating every cached
    key at every step moved ~1 GB more per layer (2.4x)."""
    row = _proxy_row(tmp_path, "block_dual_b32", "--attention", "exact")
    assert row["modeled_bytes"] <= 1.9 * row["min_bytes"], row
    assert row["weight_copies"] == 0 and row["host_syncs_per_step"] <= 1, row


@pytest.mark.skipif(gpu_proxy.plugin_problem() is not None,
                    reason="the CUDA plugin wheels are not installed (pip install -e '.[gpu-proxy]')")
def test_polestar_at_batch_32_writes_its_cache_and_store_rows_in_place(tmp_path):
    """Polestar's block program at batch 32 (2 layers at LLaDA-8B shapes), its costliest step a refresh: the
    refresh writes the block's and the packet's K/V rows and the packet's stored inputs into the stacked
    cache and store in place, and scores the block and suffix logits without splitting them: 14.0 GB a step
    against a 4.10 GB minimum (3.4x; the rest is attention's exact path and the activations of 32 x 128 rows).
    No kernel of the step copies a layer's K/V cache (a [32, 32, 512, 128] dynamic slice: the refresh moved
    each layer's cache out and back, 4 x 0.27 GB per layer, 18.5 GB a step in all, 4.5x)."""
    dump = tmp_path / "hlo"
    row = _proxy_row(tmp_path, "block_polestar_b32", "--attention", "exact", "--dump", str(dump))
    assert row["modeled_bytes"] <= 3.7 * row["min_bytes"], row
    assert row["weight_copies"] == 0 and row["host_syncs_per_step"] <= 2, row
    hlo = (dump / "block_polestar_b32.hlo.txt").read_text()
    assert not layer_copies(hlo, row["step_loop"])


def layer_copies(hlo: str, step_loop: str) -> list[str]:
    """The kernels of one iteration of ``step_loop`` whose result holds one layer's K or V cache sliced out of
    the stacked cache (or put back into it): bf16[1, 32, 32, 512, 128] at batch 32."""
    model = ht.Model(ht.parse_module(hlo))
    by_name = {ins.name: ins for comp in model.module.computations.values() for ins in comp}
    return [k for k, v in model.per_iteration(step_loop).by_kernel.items()
            if v > 0 and "bf16[1,32,32,512,128]" in by_name[k.split(":", 1)[1]].shape]


@pytest.mark.skipif(gpu_proxy.plugin_problem() is not None,
                    reason="the CUDA plugin wheels are not installed (pip install -e '.[gpu-proxy]')")
def test_polestar_block_start_attends_through_cudnn(tmp_path):
    """Polestar's block-start pass (2 layers at LLaDA-8B shapes, bf16) as a GPU with cuDNN compiles it: its
    attention is cuDNN's fused kernel, as in the plain full pass (the token drift needs the last layer's
    attention of the block rows only, [32 heads, 32, 512], computed apart the exact way), so no kernel
    holds a [32, 512, 512] float32 score or probability matrix: 2.63 GB against a 1.98 GB minimum (1.33x).
    Asking every layer's attention for its probabilities kept the exact path: 2.98 GB (1.50x)."""
    dump = tmp_path / "hlo"
    row = _proxy_row(tmp_path, "polestar_start", "--attention", "cudnn", "--dump", str(dump))
    assert row["modeled_bytes"] <= 1.4 * row["min_bytes"], row
    hlo = (dump / "polestar_start.hlo.txt").read_text()
    assert "__cudnn$fmha" in hlo and "f32[32,512,512]" not in hlo


@pytest.mark.skipif(gpu_proxy.plugin_problem() is not None,
                    reason="the CUDA plugin wheels are not installed (pip install -e '.[gpu-proxy]')")
def test_polestar_refresh_step_never_copies_the_store(tmp_path):
    """Polestar's refresh step (2 layers at LLaDA-8B shapes, batch 1, the store in device memory) writes the
    packet's stored inputs into the stacked store in place and reads stage 3's inputs from the store as
    written, so no kernel copies the store (bf16[2, 1, 96, 4096]): read from the store as it was before the
    write, it outlived the write as two whole copies a layer."""
    dump = tmp_path / "hlo"
    row = _proxy_row(tmp_path, "polestar_refresh_step", "--attention", "exact", "--dump", str(dump))
    assert row["modeled_bytes"] <= 1.2 * row["min_bytes"], row
    hlo = (dump / "polestar_refresh_step.hlo.txt").read_text()
    assert "bf16[2,1,96,4096]{3,2,1,0} copy(" not in hlo


@pytest.mark.skipif(gpu_proxy.plugin_problem() is not None,
                    reason="the CUDA plugin wheels are not installed (pip install -e '.[gpu-proxy]')")
def test_the_running_batch_traces_cudnn_attention_and_copies_no_layer_cache(tmp_path):
    """The server's running batch of 32 (the dual cache, 2 layers at LLaDA-8B shapes) with cuDNN's attention
    (which traced under the per-row vmap only since its vmap folds the rows into its batch): its rows share
    the K/V cache, so no kernel of a step copies a layer's K or V out of the stacked cache (under the per-row
    vmap the loops carried the cache rows-first and each layer's slice was copied: 2.1 GB a step at 4
    layers), and a step moves what the fixed batch's does (1.74x the minimum at 2 layers: the logits' two
    reads, attention's float32 scores and the MLP's activations). Compiles one program (~25 s)."""
    dump = tmp_path / "hlo"
    row = _proxy_row(tmp_path, "block_dual_running32", "--attention", "cudnn", "--dump", str(dump))
    assert row["modeled_bytes"] <= 1.8 * row["min_bytes"], row
    assert row["weight_copies"] == 0 and row["host_syncs_per_step"] <= 1, row
    hlo = (dump / "block_dual_running32.hlo.txt").read_text()
    assert "__cudnn$fmha" in hlo  # (the block start's full pass: the fused kernel)
    model = ht.Model(ht.parse_module(hlo))
    by_name = {ins.name: ins for comp in model.module.computations.values() for ins in comp}
    layer_kv = 32 * 32 * 512 * 128  # one layer's K (or V) at batch 32, in whatever shape the rows' vmap gives it
    copies = [k for k, v in model.per_iteration(row["step_loop"]).by_kernel.items() if v > 0 and any(
        dt == "bf16" and _count(dims) == layer_kv for dt, dims in ht.array_dims(by_name[k.split(":", 1)[1]].shape))]
    assert not copies, copies


def _count(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


_TOP1_SCRIPT = """
import json
from bench import gpu_proxy
gpu_proxy.name_platform()
import jax, jax.numpy as jnp
from bench import hlo_traffic as ht
from polestar_jax.decode import commit
sh = gpu_proxy.gpu_sharding()
logits = jax.ShapeDtypeStruct((32, 32, 126464), jnp.float32, sharding=sh)
masked = jax.ShapeDtypeStruct((32, 32), jnp.bool_, sharding=sh)
keys = jax.ShapeDtypeStruct((32, 2), jnp.uint32, sharding=sh)
out = {}
for name, fn, args in (("greedy", lambda l, m: commit.predict(l, m, 126336), (logits, masked)),
                       ("sampled", lambda l, m, k: commit.predict(l, m, 126336, 0.7, k), (logits, masked, keys))):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    out[name] = ht.Model(ht.parse_module(hlo)).run().bytes
print(json.dumps(out))
"""


@pytest.mark.skipif(gpu_proxy.plugin_problem() is not None,
                    reason="the CUDA plugin wheels are not installed (pip install -e '.[gpu-proxy]')")
def test_commit_scoring_reads_the_logits_once_on_a_gpu():
    """The commit's scoring (``commit.predict``: top-1 token and its probability) compiled for the H200 reads
    a batch of 32 blocks' float32 logits ([32, 32, 126464], 0.52 GB) once, greedy or sampling (the Gumbel
    noise made inside the same pass): the two-pass form (a max, then a sum of exponentials) read them twice."""
    proc = subprocess.run([sys.executable, "-c", _TOP1_SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logits = 32 * 32 * 126464 * 4
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # (sampling: 0.59 GB, the noise's bits made in the pass; two passes: 1.04 GB greedy, 1.11 GB sampling)
    assert logits <= got["greedy"] < 1.1 * logits and logits <= got["sampled"] < 1.2 * logits, got


# ------------------------------------------------------------------------------- device-side control flow

THUNKS = """000: kCommandBuffer [source | sink]
    001: kCopy  [source | next=003 (1)] kCopy
    003: kWhile [prev=001 (1) | sink]
condition:
        004: kCustomKernel [source | sink] input_reduce_fusion
      body:
        005: kConditional [source | sink]
006: kWhile [prev=000 (1) | sink]
condition:
    007: kCustomKernel [source | sink] loop_compare_fusion
  body:
    008: kDynamicSliceFusion [source | sink] params=2, results=2
        009: kCublasLtMatmul [source | sink] kCublasLtMatmul
    000: kCommandBuffer [source | sink]
        010: kWhile [source | sink]
"""


def test_control_flow_inside_a_command_buffer_runs_on_the_device():
    from bench import command_buffers

    assert command_buffers.control_flow(THUNKS) == {"on_host": 1, "on_device": 3}


@pytest.mark.skipif(gpu_proxy.plugin_problem() is not None,
                    reason="the CUDA plugin wheels are not installed (pip install -e '.[gpu-proxy]')")
def test_a_loop_over_stacked_weights_stays_on_the_host(tmp_path):
    """With ``while`` and ``conditional`` allowed in command buffers, XLA:GPU (jax 0.12) captures a step loop
    around a layer loop over separate weight arrays whole (it runs on the device), but not one whose layers
    read their slice of stacked weights in place (a dynamic-slice fusion): both loops stay on the host. What
    bench/README.md says of the engine's programs rests on this."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "bench.command_buffers", "--programs", "toy_stacked,toy_per_layer",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["program"]: r for r in json.loads(out.read_text())}
    meta = json.loads((tmp_path / "rows.meta.json").read_text())
    assert meta["command"].startswith("python -m bench.command_buffers --programs") and meta["jax_version"]
    assert rows["toy_stacked"] == {"program": "toy_stacked", "on_host": 2, "on_device": 0}
    assert rows["toy_per_layer"] == {"program": "toy_per_layer", "on_host": 0, "on_device": 1}

import os, sys, torch, triton
sys.path.insert(0, os.getcwd())
from benchmarks import bench_train as bt, common
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, os.getcwd(), flush=True)
leaves, do = bt.inputs(bt.B, bt.T, bt.H, bt.HV, "cuda")
def t(label, call):
    ms, err = bt._bench(bt._fwd_bwd(call, leaves, do), leaves)
    print(f"{label}: {ms} {err}", flush=True)
def fwd(label):
    import fast
    fn = lambda: fast.chunk_gated_delta_rule(*[x.detach() for x in leaves], use_qk_l2norm_in_kernel=True, chunk_size=64)
    print(label, "fwd", bt._bench(fn)[0], flush=True)
mode = sys.argv[1]
if mode == "base":
    fwd("base")
    t("base default-call", bt._fast_call)
    t("base knob", bt._fast_knob_call())
    kt = bt._step_kernel_times(bt._fast_call, leaves, do)
    print("base kernels", {k[:28]: round(v, 1) for k, v in kt.items()}, flush=True)
    bt.fla_guard_bypass()
    fla = common.try_import_fla()
    t("fla", bt._fla_call(fla.chunk_gated_delta_rule))
elif mode == "new":
    fwd("new")
    t("new default-call", bt._fast_call)
    t("new knob", bt._fast_knob_call())
    for cfg in ({"BV": 64}, {"num_stages": 1}, {"num_warps": 8}, {"BV": 64, "num_warps": 8}, {"BV": 16}):
        t(f"new knob dw {cfg}", bt._fast_knob_call(configs={"dw": cfg}))
    kt = bt._step_kernel_times(bt._fast_call, leaves, do)
    print("new kernels", {k[:28]: round(v, 1) for k, v in kt.items()}, flush=True)

if mode == "v2":
    for cfg in ({}, {"BKC": 128, "num_warps": 8}, {"BKC": 128, "num_warps": 4}, {"BKC": 128, "num_warps": 8, "BV": 64},
                {"BKC": 128, "num_warps": 8, "num_stages": 1}, {"num_warps": 8}, {"BV": 64}):
        t(f"v2 knob dqkwg {cfg}", bt._fast_knob_call(configs={"dqkwg": cfg} if cfg else None))
    for cfg in ({"num_warps": 8}, {"BV": 64}, {"BV": 64, "num_warps": 8}):
        t(f"v2 knob dh {cfg}", bt._fast_knob_call(configs={"dh": cfg}))
    for cfg in ({"BV": 128}, {"num_warps": 8}):
        t(f"v2 knob dv_local {cfg}", bt._fast_knob_call(configs={"dv_local": cfg}))

"""Entries of the optimizer ops: fused_adam_ (one Adam/AdamW step over lists
of tensors, in place).

Its arguments are lists of tensors, which the generic tests' helpers do not
take apart (they copy, convert and compare top-level tensors): the entry runs
opcheck (schema and alias annotations over the lists, fake tensors,
dynamic-shape AOT dispatch) and the invalid inputs; test/test_optim.py checks
the same invalid inputs under FakeTensorMode, and the values (every dtype against
the reference, masters, GradScaler's arguments, several chunks and launches,
CPU against CUDA, compile) and the optimizers."""

from __future__ import annotations

import torch

from .core import ErrorInput, OpInfo, Sample, Skip, make

_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, maximize=False,
              adamw=True)


def _lists(sizes, device, dtype, amsgrad=True, master=False):
    sdtype = torch.float32 if master else dtype
    params = [make(s, device, dtype) for s in sizes]
    grads = [make(s, device, dtype) for s in sizes]
    exp_avgs = [make(s, device, sdtype) for s in sizes]
    exp_avg_sqs = [make(s, device, sdtype, low=0.0, high=1.0) for s in sizes]
    maxes = [make(s, device, sdtype, low=0.0, high=1.0) for s in sizes] if amsgrad else []
    steps = [torch.tensor(float(i + 1), device=device) for i in range(len(sizes))]
    return params, grads, exp_avgs, exp_avg_sqs, maxes, steps


def _adam_samples(device, dtype, requires_grad=False):
    sizes = [(3, 5), (0,), (1,), (17,)]
    yield Sample(_lists(sizes, device, dtype), dict(_HYPER, amsgrad=True), "adamw-amsgrad")
    yield Sample(_lists(sizes[:2], device, dtype, amsgrad=False),
                 dict(_HYPER, amsgrad=False, adamw=False, maximize=True), "adam-maximize")
    scale = torch.tensor(2.0, device=device)
    yield Sample(_lists([(4, 4)], device, dtype), dict(_HYPER, amsgrad=True, grad_scale=scale,
                                                      found_inf=torch.zeros((), device=device)),
                 "scaled")
    if dtype in (torch.float16, torch.bfloat16):
        p = _lists([(6,), (2, 3)], device, dtype, master=True)
        masters = [t.float() for t in p[0]]
        yield Sample(p, dict(_HYPER, amsgrad=True, master_params=masters), "masters")


def _adam_errors(device):
    op = r"torchops\.fused_adam_: "

    def call(sizes=((3,), (2,)), amsgrad=True, **over):
        lists = list(_lists(sizes, device, torch.float32, amsgrad=amsgrad))
        names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps")
        for k, v in over.items():
            lists[names.index(k)] = v
        return Sample(tuple(lists), dict(_HYPER, amsgrad=amsgrad))

    f = lambda *s, dt=torch.float32: make(s, device, dt)  # noqa: E731
    yield ErrorInput(call(grads=[f(3)]), op + r"expected 'grads' to have 2 tensors")
    yield ErrorInput(call(max_exp_avg_sqs=[]), op + r"expected 'max_exp_avg_sqs' to have 2")
    yield ErrorInput(call(exp_avgs=[f(3), f(2, dt=torch.float64)]),
                     op + r"expected 'exp_avgs\[1\]' to have dtype")
    yield ErrorInput(call(exp_avg_sqs=[f(3), f(3)]), op + r"'exp_avg_sqs\[1\]' has shape")
    yield ErrorInput(call(grads=[f(3), f(2, 2)[:, 0]]), op + r"'grads\[1\]' must be dense")
    yield ErrorInput(call(state_steps=[torch.tensor(1.0, device=device), f(2)]),
                     op + r".*'state_steps\[1\]'")
    p = f(3)
    yield ErrorInput(call(sizes=((3,), (3,)), params=[p, p]), op + r"'params\[1\]' appears twice")
    yield ErrorInput(call(params=[f(3), f(2, dt=torch.float64)]),
                     op + r"expected 'params\[1\]' to have dtype")
    yield ErrorInput(call(grads=[f(3), torch.zeros(2, device=device).to_sparse()]),
                     op + r"'grads\[1\]'.*sparse", kernel_only="fake tensors of sparse "
                     "layouts are not what the fake's check sees")
    if device != "cpu":
        yield ErrorInput(call(exp_avgs=[f(3), make((2,), "cpu", torch.float32)]),
                         op + r"'exp_avgs\[1\]' is on")


_LISTS = ("the arguments are lists of tensors, which the generic helpers do not copy, convert "
          "or compare; test_optim.py checks the values")

FUSED_ADAM_ = OpInfo(
    name="fused_adam_",
    sample_inputs=_adam_samples,
    error_inputs=_adam_errors,
    differentiable=False,
    skips=[Skip(t, _LISTS) for t in ("correctness", "wrapper", "cpu_vs_cuda", "autocast",
                                     "compile", "cuda_graph", "export", "property",
                                     "sample_variety", "fake_error_inputs")],
)

OPTIM_OPS = [FUSED_ADAM_]


# --- optim: fused_sgd_ (one SGD step over lists of tensors, in place) ---

_SGD_HYPER = dict(weight_decay=0.1, momentum=0.9, lr=1e-2, dampening=0.1, nesterov=False,
                  maximize=False, is_first_step=False)


def _sgd_lists(sizes, device, dtype, momentum=True, master=False):
    sdtype = torch.float32 if master else dtype
    params = [make(s, device, dtype) for s in sizes]
    grads = [make(s, device, dtype) for s in sizes]
    bufs = [make(s, device, sdtype) for s in sizes] if momentum else []
    return params, grads, bufs


def _sgd_samples(device, dtype, requires_grad=False):
    sizes = [(3, 5), (0,), (1,), (17,)]
    yield Sample(_sgd_lists(sizes, device, dtype), dict(_SGD_HYPER), "momentum-dampening")
    yield Sample(_sgd_lists(sizes[:2], device, dtype),
                 dict(_SGD_HYPER, dampening=0.0, nesterov=True, maximize=True,
                      is_first_step=True), "nesterov-first-step")
    yield Sample(_sgd_lists(sizes[2:], device, dtype, momentum=False),
                 dict(_SGD_HYPER, momentum=0.0), "no-momentum")
    yield Sample(_sgd_lists([(4, 4)], device, dtype),
                 dict(_SGD_HYPER, grad_scale=torch.tensor(2.0, device=device),
                      found_inf=torch.zeros((), device=device)), "scaled")
    if dtype in (torch.float16, torch.bfloat16):
        p = _sgd_lists([(6,), (2, 3)], device, dtype, master=True)
        yield Sample(p, dict(_SGD_HYPER, master_params=[t.float() for t in p[0]]), "masters")


def _sgd_errors(device):
    op = r"torchops\.fused_sgd_: "

    def call(sizes=((3,), (2,)), momentum=0.9, **over):
        lists = list(_sgd_lists(sizes, device, torch.float32, momentum=momentum != 0))
        names = ("params", "grads", "momentum_buffer_list")
        for k, v in over.items():
            if k in names:
                lists[names.index(k)] = v
        kw = {k: v for k, v in over.items() if k not in names}
        return Sample(tuple(lists), dict(_SGD_HYPER, momentum=momentum, **kw))

    f = lambda *s, dt=torch.float32: make(s, device, dt)  # noqa: E731
    yield ErrorInput(call(grads=[f(3)]), op + r"expected 'grads' to have 2 tensors")
    yield ErrorInput(call(momentum_buffer_list=[f(3)]),
                     op + r"expected 'momentum_buffer_list' to have 2 tensors")
    yield ErrorInput(call(momentum=0.0, momentum_buffer_list=[f(3), f(2)]),
                     op + r"expected 'momentum_buffer_list' to have 0 tensors \(none without "
                     r"momentum\)")
    yield ErrorInput(call(momentum_buffer_list=[f(3), f(2, dt=torch.float64)]),
                     op + r"expected 'momentum_buffer_list\[1\]' to have dtype")
    yield ErrorInput(call(momentum_buffer_list=[f(3), f(3)]),
                     op + r"'momentum_buffer_list\[1\]' has shape")
    yield ErrorInput(call(grads=[f(3), f(2, 2)[:, 0]]), op + r"'grads\[1\]' must be dense")
    p = f(3)
    yield ErrorInput(call(sizes=((3,), (3,)), params=[p, p]), op + r"'params\[1\]' appears twice")
    yield ErrorInput(call(params=[f(3), f(2, dt=torch.float64)]),
                     op + r"expected 'params\[1\]' to have dtype")
    yield ErrorInput(call(master_params=[f(3)]), op + r"expected 'master_params' to have 2")
    yield ErrorInput(call(master_params=[f(3), f(2)]),
                     op + r"with 'master_params', expected 'params' to be float16 or bfloat16")
    yield ErrorInput(call(grad_scale=f(2)), op + r"expected 'grad_scale' to be a float32 tensor")
    yield ErrorInput(call(grads=[f(3), torch.zeros(2, device=device).to_sparse()]),
                     op + r"'grads\[1\]'.*sparse", kernel_only="fake tensors of sparse "
                     "layouts are not what the fake's check sees")
    if device != "cpu":
        yield ErrorInput(call(momentum_buffer_list=[f(3), make((2,), "cpu", torch.float32)]),
                         op + r"'momentum_buffer_list\[1\]' is on")


FUSED_SGD_ = OpInfo(
    name="fused_sgd_",
    sample_inputs=_sgd_samples,
    error_inputs=_sgd_errors,
    differentiable=False,
    skips=[Skip(t, _LISTS.replace("test_optim.py", "test_sgd.py"))
           for t in ("correctness", "wrapper", "cpu_vs_cuda", "autocast", "compile",
                     "cuda_graph", "export", "property", "sample_variety", "fake_error_inputs")],
)

OPTIM_OPS.append(FUSED_SGD_)


# --- multi_tensor_l2norm, multi_tensor_scale_ ---

def _norm_list(device, dtype):
    # Odd sizes, an empty tensor, a size-1 dim, a transposed (dense) tensor.
    return [make((3, 5), device, dtype), make((0,), device, dtype), make((1, 7), device, dtype),
            make((4, 6), device, dtype).t(), make((17,), device, dtype)]


def _l2norm_samples(device, dtype, requires_grad=False):
    yield Sample((_norm_list(device, dtype), True), name="per-tensor")
    yield Sample((_norm_list(device, dtype)[:2], False), name="total")
    for n in (3, 10, 33):
        yield Sample(([make((n,), device, dtype), make((n, 2), device, dtype)], True),
                     name=f"size-{n}")


def _list_errors(device, call, op):
    f = lambda *s, dt=torch.float32: make(s, device, dt)  # noqa: E731
    yield ErrorInput(call([f(3), f(2, dt=torch.float64)]),
                     op + r"expected 'tensors\[1\]' to have dtype")
    yield ErrorInput(call([f(3), f(4, 2)[:, 0]]), op + r"'tensors\[1\]' must be dense")
    yield ErrorInput(call([torch.zeros(3, device=device, dtype=torch.int64)]),
                     op + r"expected 'tensors\[0\]' to be a floating-point tensor")
    yield ErrorInput(call([f(3), torch.zeros(2, device=device).to_sparse()]),
                     op + r"'tensors\[1\]' must be a dense \(strided\)",
                     kernel_only="fake tensors of sparse layouts are not what the fake's check "
                     "sees")
    if device != "cpu":
        yield ErrorInput(call([f(3), make((2,), "cpu", torch.float32)]),
                         op + r"'tensors\[1\]' is on")


def _l2norm_errors(device):
    op = r"torchops\.multi_tensor_l2norm: "
    yield from _list_errors(device, lambda ts: Sample((ts, False)), op)


def _scale_samples(device, dtype, requires_grad=False):
    yield Sample((_norm_list(device, dtype), 0.25), name="float")
    for n in (3, 10, 33):
        yield Sample(([make((n,), device, dtype), make((n, 2), device, dtype)], -1.5),
                     name=f"size-{n}")


def _scale_errors(device):
    op = r"torchops\.multi_tensor_scale_: "
    yield from _list_errors(device, lambda ts: Sample((ts, 2.0)), op)
    p = make((3,), device, torch.float32)
    yield ErrorInput(Sample(([p, p], 2.0)), op + r"'tensors\[1\]' appears twice")
    yield ErrorInput(Sample(([make((3,), device, torch.float32)],
                             torch.ones(2, device=device))),
                     op + r"expected 'scale' to be a float32 or float64 tensor of one element",
                     via_wrapper=True)
    yield ErrorInput(Sample(([make((3,), device, torch.float32)],
                             torch.ones((), device=device, dtype=torch.float16))),
                     op + r"expected 'scale' to be a float32 or float64",
                     via_wrapper=True)


_NORM_SKIPS = [Skip(t, _LISTS.replace("test_optim.py", "test_clip_grad.py"))
               for t in ("correctness", "wrapper", "cpu_vs_cuda", "autocast", "compile",
                         "cuda_graph", "export", "property", "sample_variety",
                         "fake_error_inputs")]

MULTI_TENSOR_L2NORM = OpInfo(
    name="multi_tensor_l2norm",
    sample_inputs=_l2norm_samples,
    error_inputs=_l2norm_errors,
    differentiable=False,
    skips=_NORM_SKIPS,
)

MULTI_TENSOR_SCALE_ = OpInfo(
    name="multi_tensor_scale_",
    sample_inputs=_scale_samples,
    error_inputs=_scale_errors,
    differentiable=False,
    skips=_NORM_SKIPS,
)

OPTIM_OPS += [MULTI_TENSOR_L2NORM, MULTI_TENSOR_SCALE_]

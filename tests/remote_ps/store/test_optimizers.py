"""Each sparse rule against PyTorch's own optimizer on the touched rows."""
import pytest
import torch

from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.optimizers import make_rule
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import SGD, Adagrad, Adam, Constant, TableConfig, Uniform

DIM = 8


def _store(optimizer, **table_args) -> ShardStore:
    store = ShardStore(shard_index=0, num_shards=1, seed=3)
    store.configure(TableConfig("t", DIM, optimizer=optimizer, init=Uniform(-0.5, 0.5), **table_args))
    return store


def _torch_reference(make_optimizer, initial: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """One torch parameter per row, stepped only when that row gets a gradient (lazy sparse semantics)."""
    params = [torch.nn.Parameter(row.clone()) for row in initial]
    optimizers = [make_optimizer([p]) for p in params]
    for step_grads in grads:
        for p, opt, g in zip(params, optimizers, step_grads):
            if g is None:
                continue
            p.grad = g.clone()
            opt.step()
    return torch.stack([p.detach() for p in params])


CASES = [
    (SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (SGD(lr=0.1, weight_decay=0.01), lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01)),
    (Adagrad(lr=0.05), lambda p: torch.optim.Adagrad(p, lr=0.05, eps=1e-10)),
    (Adagrad(lr=0.05, weight_decay=0.02, initial_accumulator_value=0.1), lambda p: torch.optim.Adagrad(p, lr=0.05, eps=1e-10, weight_decay=0.02, initial_accumulator_value=0.1)),
    (Adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    (Adam(lr=0.01, betas=(0.8, 0.9), weight_decay=0.01), lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.9), weight_decay=0.01)),
]


@pytest.mark.parametrize("optimizer,make_reference", CASES, ids=[repr(c[0]) for c in CASES])
def test_rule_matches_torch_optimizer(optimizer, make_reference):
    store = _store(optimizer)
    ids = torch.tensor([5, -9, 1 << 40, 77])
    initial = store.lookup("t", ids, train=True)
    gen = torch.Generator().manual_seed(0)
    steps = []
    for step in range(5):
        touched = [i for i in range(4) if (i + step) % 3 != 0]  # rows skip some steps
        g = torch.randn(len(touched), DIM, generator=gen)
        store.update("t", ids[touched], g)
        per_row = [None] * 4
        for j, i in enumerate(touched):
            per_row[i] = g[j]
        steps.append(per_row)
    expected = _torch_reference(make_reference, initial, steps)
    torch.testing.assert_close(store.lookup("t", ids, train=False), expected, rtol=1e-5, atol=1e-6)


def test_rowwise_adagrad_rule():
    store = _store(Adagrad(lr=0.1, rowwise=True))
    ids = torch.tensor([1, 2])
    w = store.lookup("t", ids, train=True)
    state = torch.zeros(2, 1)
    for step in range(3):
        g = torch.full((2, DIM), float(step + 1)) * torch.tensor([[1.0], [-2.0]])
        store.update("t", ids, g)
        state += g.square().mean(dim=1, keepdim=True)
        w = w - 0.1 * g / (state.sqrt() + 1e-10)
    torch.testing.assert_close(store.lookup("t", ids, train=False), w)


def test_weight_bound_clips_updated_rows():
    store = _store(SGD(lr=1.0), weight_bound=0.25)
    ids = torch.tensor([4, 8])
    store.lookup("t", ids, train=True)
    store.update("t", ids, torch.tensor([[-10.0] * DIM, [10.0] * DIM]))
    rows = store.lookup("t", ids, train=False)
    assert torch.equal(rows, torch.tensor([[0.25] * DIM, [-0.25] * DIM]))


def test_duplicate_ids_in_one_update_are_summed():
    store = _store(SGD(lr=1.0))
    store.configure(TableConfig("z", DIM, optimizer=SGD(lr=1.0), init=Constant(0.0)))
    store.lookup("z", torch.tensor([1]), train=True)
    store.update("z", torch.tensor([1, 1, 1]), torch.ones(3, DIM))
    assert torch.equal(store.lookup("z", torch.tensor([1]), train=False), torch.full((1, DIM), -3.0))


NATIVE_RULES = [SGD(lr=0.1), SGD(lr=0.1, weight_decay=0.01), Adagrad(lr=0.1),
                Adagrad(lr=0.1, weight_decay=0.02, initial_accumulator_value=0.1), Adagrad(lr=0.1, rowwise=True),
                Adagrad(lr=0.1, rowwise=True, weight_decay=0.01)]


@pytest.mark.parametrize("optimizer", NATIVE_RULES, ids=[repr(o) for o in NATIVE_RULES])
def test_the_tensor_rule_equals_the_native_kernel_bit_for_bit(native_kernels, optimizer):
    """The store applies an update with the tensor rule while a save or a move's point read is open, and with the
    native kernel otherwise: a row must come out the same either way (a run at staleness 0 that moved shards ended a
    unit in the last place apart from one that did not, when the rule's mean and sqrt rounded otherwise)."""
    config = TableConfig("t", 16, optimizer=optimizer, init=Uniform(-0.1, 0.1))
    ids = torch.arange(3000)
    rows = []
    for path in ("native", "tensor"):
        table = Table(config, seed=0)
        table.lookup(ids, train=True)
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            grads = (torch.randn(ids.numel(), 16, generator=generator) * 0.01).half().float()  # fp16 on the wire
            if path == "native":
                Table.update_together([(table, ids, grads)])
            else:
                with table.locked():
                    table._update_locked(ids, grads)
        rows.append(table.lookup(ids, train=False))
    assert torch.equal(rows[0], rows[1]), f"{int((rows[0] != rows[1]).sum())} values differ"



class _DevicesMade(torch.overrides.TorchFunctionMode):
    """Records the device of every tensor a torch call returns."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor):
            self.devices.add(result.device.type)
        return result


@pytest.mark.parametrize("optimizer", NATIVE_RULES + [Adam(lr=0.01)], ids=[repr(o) for o in NATIVE_RULES + [Adam(lr=0.01)]])
def test_a_rule_computes_on_the_device_of_its_rows(optimizer):
    """The trainer applies these rules to the tables it keeps itself, on the GPU, where a tensor a rule makes on the
    CPU stops the step (a device-mismatch error). The meta device stands in for CUDA on a machine without one."""
    rule = make_rule(optimizer, DIM)
    weights, grads = torch.empty(5, DIM, device="meta"), torch.empty(5, DIM, device="meta")
    state = rule.initial_state(5).to("meta")
    with _DevicesMade() as made:
        rule.apply(weights, state, grads)
    assert made.devices == {"meta"}, f"{type(rule).__name__} made tensors on {sorted(made.devices)}"


@pytest.mark.parametrize("optimizer", NATIVE_RULES, ids=[repr(o) for o in NATIVE_RULES])
def test_a_rule_outside_the_kernels_order_computes_the_same_update_to_rounding(optimizer):
    """The trainer's kept tables take torch's own reductions and sqrt (no kernel to match there): the same rule, a
    rounding apart."""
    generator = torch.Generator().manual_seed(5)
    weights, grads = torch.randn(300, DIM, generator=generator), torch.randn(300, DIM, generator=generator) * 0.1
    results = []
    for kernel_order in (True, False):
        rule = make_rule(optimizer, DIM, kernel_order=kernel_order)
        w, state = weights.clone(), rule.initial_state(300)
        for _ in range(3):
            rule.apply(w, state, grads)
        results.append((w, state))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=1e-6)
    assert not torch.equal(results[0][0], weights)

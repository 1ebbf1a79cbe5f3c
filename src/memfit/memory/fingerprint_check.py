"""The quick check of a kept `model_state` value (`State.holds`): True only where a new value would be equal,
without building it. `plan.step` asks it once a step and the memory-model caches once a call, so it must cost a small
part of a step: it compares flat lists by C loops (`map`, `compress`, `gc.get_referents`) rather than a Python call per
attribute, and skips what no dict write changed (torch's dict versions): ViT-tiny 204 -> 55 us a check, ResNet-50
836 -> 259 us (timeit, same process, medians of 15 pairs on a busy 2-core machine; the tensors' properties are most
of what is left: 320 tensors' storage, shape, dtype and requires_grad on ResNet-50). Those properties compared by
torch's C++ tensor check (`Quick._tensors_hold`): the bench's ViT 47 -> 33 us, BERT 54 -> 38 us.

Example:
    >>> import torch
    >>> from memfit.memory.fingerprint import model_state
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    >>> kept = model_state(m)
    >>> kept.holds(m)
    True
    >>> m[1].p = 0.5
    >>> kept.holds(m)
    False
"""

from __future__ import annotations

import functools
import gc
import itertools
import operator
import weakref

import torch

import memfit.memory.model_value as fp  # the value's pieces (`_value`, `State`)
from memfit.device.torch_private import MODULE_DICTS, dict_version_reader, own_children, tensor_guards

__all__ = ["Quick"]


class Quick:
    """What `State.holds` compares, each part by a few C loops over flat lists (`gc.get_referents`, `map`, `compress`)
    rather than a Python call per attribute (ViT-tiny has 760 module attributes, ResNet-50 4,200, most of them the
    empty hook dicts). Two ways:
    - quick (`same`): where no dict was written since the value was taken (torch's dict versions, `_dict_version`: of
      every module's `__dict__`, of its non-empty `_modules`, `_parameters` and `_buffers`, of each config object's
      `__dict__`), every attribute holds the object it held, so only what is not a dict is compared: the empty
      containers still empty, each parameter's and buffer's storage, shape, dtype and requires_grad, each config's
      class, the small containers' elements, what may change inside an object held (a tensor attribute's version);
    - in full (`_same`, where a version moved or torch has no reader): per module its attributes' names, in order;
      their values as `gc.get_referents` lists a module's `__dict__` (its values in order, one C call for every
      module; checked at `done` to list exactly `dict.values()`, else the model is not quick): plain ones (None,
      numbers, strings, tuples of them) and empty containers held here and compared by identity (the containers must
      stay empty), the others by id (`deep_refs` alive: an equal id is the same object) and again as `_value` gives
      them; the contents of the non-empty `_modules`, `_parameters` and `_buffers` dicts (the same objects, held
      weakly, None where a dict held None); the tensors' properties; each config's class, names and fields the same
      way as a module's. Where that finds the model as it was, the versions are taken again (a value set and set back).
    Both check the modules themselves (held weakly: alive, the same objects, the root first); the same root with the
    same submodules in every module walks to the same modules, so the walk is not redone. So `same` is True only
    where `model_state` would give an equal value. A model whose modules' own `named_modules` walks otherwise, or with
    an uninitialized (lazy) parameter, is never quick (`done` gives None)."""
    __slots__ = ("address", "changeable", "checker", "classes", "config_at", "config_count", "config_deep",
                 "config_empty", "config_flat", "config_in", "config_keys", "config_mask", "config_pinned",
                 "config_types", "count", "deep", "deep_refs", "empty", "flat", "ids", "keys", "mask", "modules",
                 "others", "own_at", "own_in", "own_names", "own_refs", "own_slices", "per_module", "pinned",
                 "tensor_mask", "tensor_refs", "tensors", "types", "versions")

    def __init__(self, modules: list):
        self.pinned: list = []          # the attribute values compared by identity, in walk order, held
        self.mask: list[bool] = []      # per attribute in walk order: among `pinned`
        self.empty: list = []           # the empty containers among them: they must stay empty
        self.deep: list[tuple[int, str, object]] = []      # (module index, attribute, its `_value`)
        self.deep_refs: list = []       # the weak references `_value` took of the objects the deep values name
        self.modules = [weakref.ref(m) for m in modules]
        self.types = list(map(type, modules))      # a class swapped in (`m.__class__ = Other`): another forward

    def hold(self, v) -> None:
        self.pinned.append(v)
        self.mask.append(True)

    def done(self, model: torch.nn.Module, modules: list) -> Quick | None:
        walked = _walk(model)
        if len(walked) != len(modules) or not all(map(operator.is_, walked, modules)):
            return None                                           # a module's own `named_modules`: no shortcut
        fields = list(map(vars, modules))
        values = gc.get_referents(*fields)
        if len(values) != len(self.mask) or not all(map(operator.is_, values, itertools.chain.from_iterable(
                map(dict.values, fields)))):
            return None                          # a `__dict__` with keys other than strings: its keys are listed too
        self.keys, self.count, self.empty = list(map(tuple, fields)), len(values), tuple(self.empty)
        self.pinned, self.mask = tuple(self.pinned), tuple(self.mask)
        self.others = operator.itemgetter(*(i for i, pinned in enumerate(self.mask) if not pinned), 0, 0)
        self.ids = tuple(map(id, self.others(values)))
        # where the non-empty `_modules`, `_parameters`, `_buffers` dicts sit in `values` (an empty one is pinned)
        starts = itertools.accumulate(map(len, fields), initial=0)
        places = [(i, start + keys.index(k), k) for i, (keys, start, f) in enumerate(zip(self.keys, starts, fields,
                                                                                        strict=False))
                  for k in _OWNED if f.get(k)]
        self.own_at = operator.itemgetter(*(at for _, at, _ in places), 0, 0)   # a tuple even for 0 or 1 places
        self.own_in = (operator.itemgetter(*(i for i, _, _ in places), 0, 0), tuple(k for _, _, k in places))
        own = _own(self.own_at, values)
        self.own_names = tuple(map(tuple, self.own_at(values)[:-2]))   # their keys: `model_state` lists the names
        if any(isinstance(t, torch.nn.parameter.UninitializedTensorMixin) for t in own):
            return None
        self.own_refs = [_DEAD if x is None else weakref.ref(x) for x in own]
        # per module (names, which are pinned, the pinned values, the others' ids) and per non-empty dict of its own
        # (where its entries sit in `own_refs`): what `_moved` compares of the dicts a step wrote
        ends = list(itertools.accumulate(map(len, self.keys)))
        self.per_module = [(keys, self.mask[end - len(keys):end],
                            tuple(itertools.compress(values[end - len(keys):end], self.mask[end - len(keys):end])),
                            tuple(id(v) for v, pinned in zip(values[end - len(keys):end],
                                                             self.mask[end - len(keys):end], strict=True)
                                  if not pinned))
                           for keys, end in zip(self.keys, ends, strict=True)]
        sizes = [len(fields[i][k]) for i, _, k in places]
        self.own_slices = [(end - n, end) for n, end in zip(sizes, itertools.accumulate(sizes), strict=True)]
        self.tensor_mask = tuple(isinstance(x, torch.Tensor) for x in own)
        tensors = list(itertools.compress(own, self.tensor_mask))
        self.tensor_refs = list(itertools.compress(self.own_refs, self.tensor_mask))
        # a tensor subclass's own `data_ptr` is called as `_tensor` calls it; a plain one's without the method lookup
        self.address = (_DATA_PTR if all(type(t).data_ptr is _DATA_PTR for t in tensors)
                        else operator.methodcaller("data_ptr"))
        try:
            self.tensors = _properties(tensors, self.address)
        except (RuntimeError, ValueError, TypeError, AttributeError):    # a tensor subclass without storage
            return None
        self.checker = tensor_checker(tensors)
        return self._configs(fields, values)

    def _configs(self, fields: list, values: list) -> Quick | None:
        """The config objects among the deep values (`_value` lists their fields: ViT's config, held by 6 of its
        modules, has 50), checked once each as the modules are: type, field names, fields by identity where their
        `_value` is decided by the object (None, numbers, strings, tuples of them, empty containers watched), the
        rest (a tensor, a filled dict, another object) again as `_value` gives them."""
        starts = list(itertools.accumulate(map(len, fields), initial=0))
        configs: dict[int, object] = {}
        at, deep = [], []
        for i, k, was in self.deep:
            v = fields[i][k]
            if _fields_of(v) is None:
                deep.append((i, k, was))
            elif id(v) not in configs:              # its id and aliveness: among `ids` and `deep_refs`
                configs[id(v)] = v
                at.append((i, starts[i] + self.keys[i].index(k), k))
        self.deep = tuple(deep)
        self.config_at = operator.itemgetter(*(p for _, p, _ in at), 0, 0)
        self.config_in = (operator.itemgetter(*(i for i, _, _ in at), 0, 0), tuple(k for _, _, k in at))
        self.config_types = list(map(type, configs.values()))
        got = list(map(vars, configs.values()))
        values = gc.get_referents(*got)
        if len(values) != sum(map(len, got)) or not all(map(operator.is_, values, itertools.chain.from_iterable(
                map(dict.values, got)))):
            return None
        self.config_keys, self.config_count = list(map(tuple, got)), len(values)
        kinds = list(map(_kind, values))
        self.config_mask = tuple(kind < 2 for kind in kinds)
        self.config_pinned = tuple(itertools.compress(values, self.config_mask))
        # a config with no fields is watched as an empty container: torch's reader from Python 3.12 (a dict watcher)
        # leaves the version of an empty dict filled by `update` from another as it was
        self.config_empty = (*(v for v, kind in zip(values, kinds, strict=True) if kind == 1),
                             *(f for f in got if not f))
        scratch = fp.State((), [], [])     # the objects are alive: model_state holds them, and `deep_refs` with it
        places = [(j, k) for j, f in enumerate(got) for k in f]
        self.config_deep = [(j, k, fp._value(v, 1, {}, scratch))
                            for (j, k), v, kind in zip(places, values, kinds, strict=True) if kind == 2]
        # a small container of plain values (a config's id2label, a model's _no_split_modules) by its elements' identity
        self.flat = [(i, k, _flat(fields[i][k])) for i, k, _ in self.deep]
        self.config_flat = [(j, k, _flat(got[j][k])) for j, k, _ in self.config_deep]
        self.deep = tuple(e for e, (_, _, flat) in zip(self.deep, self.flat, strict=True) if flat is None)
        self.config_deep = tuple(e for e, (_, _, flat) in zip(self.config_deep, self.config_flat, strict=True)
                                 if flat is None)
        self.flat = tuple(e for e in self.flat if e[2] is not None)
        self.config_flat = tuple(e for e in self.config_flat if e[2] is not None)
        # what may change inside an object a module's dict still holds (a tensor's version, a set's elements): not
        # what `_value` names by id alone ("object": a function or module, GELU's `act`), whose class is checked; a
        # callable container or tensor (a dict subclass with __call__) is compared by content, as `_value` does
        named = [type(was) is tuple and was[:1] == ("object",) for _, _, was in self.deep]
        self.changeable = tuple(e for e, by_id in zip(self.deep, named, strict=True) if not by_id)
        self.classes = tuple((i, k, type(fields[i][k])) for (i, k, _), by_id in zip(self.deep, named, strict=True)
                             if by_id)
        version = _dict_version()
        self.versions = None if version is None else self._versions(fields, version)
        return self

    def _dicts(self, fields: list) -> tuple[list, list, list]:
        """(the non-empty `_modules`/`_parameters`/`_buffers` dicts, the config objects, their `__dict__`s), looked up
        in the modules' `__dict__`s `fields` where they were (KeyError where one is gone)."""
        holders, keys = self.own_in
        own = list(map(dict.__getitem__, holders(fields)[:-2], keys))
        holders, keys = self.config_in
        configs = list(map(dict.__getitem__, holders(fields)[:-2], keys))
        return own, configs, list(map(vars, configs))

    def _versions(self, fields: list, version) -> tuple:
        own, _, got = self._dicts(fields)
        return tuple(map(version, itertools.chain(fields, own, got)))

    def same(self, model: torch.nn.Module) -> bool:
        modules = list(map(fp._DEREF, self.modules))
        if modules[0] is not model or None in modules or list(map(type, modules)) != self.types:
            return False
        fields = list(map(vars, modules))
        version = _dict_version() if self.versions is not None else None
        try:
            own, configs, got = self._dicts(fields) if version is not None else ((), (), ())
            now = None if version is None else tuple(map(version, itertools.chain(fields, own, got)))
        except (KeyError, TypeError):       # an attribute that held a dict or config gone: compared in full, unequal
            now = None
        if now is None:
            return self._same(fields)
        # a dict whose version is as it was has not been written since the value was taken (a dict's version changes
        # with every write and is never reused): it holds the same objects, in the same places. A dict written since
        # (`plan.step` sets and removes a checkpointed module's `forward` every step) is compared as `_same` does.
        if now != self.versions and not self._moved(fields, own, got, now):
            return False
        # what is not a dict is compared still: the empty containers, the tensors' properties, a config's class, the
        # small containers, the tensor attributes' versions
        if (any(self.empty) or any(self.config_empty)
                or any(map(operator.is_, map(fp._DEREF, self.deep_refs), itertools.repeat(None)))):
            return False                    # a container filled; an object a deep value names by id collected
        if configs and list(map(type, configs)) != self.config_types:
            return False
        try:
            if not self._tensors_hold(list(map(fp._DEREF, self.tensor_refs))):
                return False
        except (RuntimeError, ValueError, TypeError, AttributeError):
            return False
        if not (all(type(fields[i][k]) is t for i, k, t in self.classes) and self._rest(fields, got, self.changeable)):
            return False
        self.versions = now              # as it was: the dicts written since compared, quick again from now on
        return True

    def _moved(self, fields: list, own: list, got: list, now: tuple) -> bool:
        """The dicts whose versions moved are as they were (`_same`'s comparison for those alone): a module's
        attributes (names, pinned values, the others' ids), a `_modules`/`_parameters`/`_buffers` dict's entries;
        any config written, every config's fields."""
        moved = list(itertools.compress(itertools.count(), map(operator.ne, now, self.versions)))
        n, m = len(fields), len(fields) + len(own)
        if any(map(operator.is_, map(fp._DEREF, self.deep_refs), itertools.repeat(None))):
            return False                   # an object named by id collected: an equal id may be another's
        for i in moved:
            if i < n:
                keys, mask, pinned, ids = self.per_module[i]
                values = gc.get_referents(fields[i])
                if (tuple(fields[i]) != keys or len(values) != len(keys)
                        or not all(map(operator.is_, itertools.compress(values, mask), pinned))
                        or tuple(map(id, itertools.compress(values, map(operator.not_, mask)))) != ids):
                    return False
            elif i < m:
                start, end = self.own_slices[i - n]
                entries = list(_VALUES(own[i - n]))
                if (tuple(own[i - n]) != self.own_names[i - n] or len(entries) != end - start
                        or not all(map(operator.is_, entries, map(fp._DEREF, self.own_refs[start:end])))):
                    return False
            else:
                return self._configs_same(got)
        return True

    def _same(self, fields: list) -> bool:
        """`same`, comparing every attribute (a dict of the model was written since the value was taken)."""
        try:
            if list(map(tuple, fields)) != self.keys:                           # names added, removed, reordered
                return False
            values = gc.get_referents(*fields)      # the keys are the strings they were: the values, in their order
            if (len(values) != self.count or not all(map(operator.is_, itertools.compress(values, self.mask),
                                                           self.pinned))
                    or any(self.empty) or tuple(map(id, self.others(values))) != self.ids
                    or any(map(operator.is_, map(fp._DEREF, self.deep_refs), itertools.repeat(None)))):
                return False
            if tuple(map(tuple, self.own_at(values)[:-2])) != self.own_names:
                return False                  # a submodule, parameter or buffer renamed (objects in the same order)
            own = _own(self.own_at, values)
            if len(own) != len(self.own_refs) or not all(map(operator.is_, own, map(fp._DEREF, self.own_refs))):
                return False                  # a submodule, parameter or buffer added, removed or replaced
            if not self._tensors_hold(list(itertools.compress(own, self.tensor_mask))):
                return False
            configs = self.config_at(values)[:-2]
            if configs and list(map(type, configs)) != self.config_types:
                return False
            got = list(map(vars, configs))
            if not self._configs_same(got):
                return False
        except (RuntimeError, ValueError, TypeError, AttributeError):
            return False
        return self._rest(fields, got, self.deep)

    def _tensors_hold(self, tensors: list) -> bool:
        """The parameters and buffers (`tensors`, in walk order) have the storage, shape, dtype, requires_grad and
        strides they had: the storage by address, the rest by torch's C++ check (`tensor_checker`: ViT-tiny's 40
        tensors 2.7 us, read in Python 15 us of a 46 us `same`), else, where it says no (it also says no under another
        autocast or inference mode than it was made under) or there is none, read and compared as they were recorded.
        Raises TypeError for a collected tensor (None)."""
        if (self.checker is not None and tuple(map(self.address, tensors)) == self.tensors[0]
                and self.checker(*tensors)):
            return True
        return _properties(tensors, self.address) == self.tensors

    def _configs_same(self, got: list) -> bool:
        """The configs' fields (their `__dict__`s `got`): names, pinned values, empty containers still empty."""
        if list(map(tuple, got)) != self.config_keys:
            return False
        values = gc.get_referents(*got)
        return (len(values) == self.config_count and all(map(operator.is_, itertools.compress(
            values, self.config_mask), self.config_pinned)) and not any(self.config_empty))

    def _rest(self, fields: list, got: list, deep: tuple) -> bool:
        """The small containers by their elements, the other deep values (`deep`) again as `_value` gives them."""
        seen: dict[int, object] = {}
        scratch = fp.State((), [], [])                  # the objects `_value` names now: alive, being looked at
        return (all(_unchanged(fields[i][k], flat) for i, k, flat in self.flat)
                and all(_unchanged(got[j][k], flat) for j, k, flat in self.config_flat)
                and all(fp._value(fields[i][k], 0, seen, scratch) == was for i, k, was in deep)
                and all(fp._value(got[j][k], 1, seen, scratch) == was for j, k, was in self.config_deep))


_OWNED = MODULE_DICTS


class _Holder:
    def __init__(self):
        self.a = 1


@functools.cache
def _dict_version():
    """torch's reader of a dict's version (`torch._C._dynamo.guards.dict_version`, what `torch.compile`'s guards on a
    module's `__dict__` read: CPython's `ma_version_tag` before 3.12 (PEP 509), a dict watcher's count from 3.12): a
    number that changes with every write to the dict and that no other dict has had. None where torch has none, or
    where it does not behave so on this interpreter (checked once on dicts of its own): `Quick` then compares in
    full every time."""
    try:
        dict_version = dict_version_reader()
        d, other = {"a": 1}, {"a": 1}
        seen = [dict_version(d), dict_version(other)]
        for write in (lambda: d.__setitem__("a", 2), lambda: d.__setitem__("b", 1), lambda: d.__delitem__("b"),
                      lambda: d.update(a=3), lambda: d.setdefault("c", 0), lambda: d.pop("c"), lambda: d.clear(),
                      lambda: d.__setitem__("a", 1), lambda: d.popitem()):
            write()
            seen.append(dict_version(d))
        holder = _Holder()          # an instance's own `__dict__` (CPython keeps some attributes outside it until
        fields = vars(holder)       # it is asked for): setting an attribute writes it
        seen.append(dict_version(fields))
        holder.a = 2
        seen.append(dict_version(fields))
        if len(set(seen)) != len(seen) or dict_version(d) != seen[-3]:
            return None
    except Exception:       # noqa: BLE001 -- any failure of a private reader: the full comparison, always right
        return None
    return dict_version


def tensor_checker(tensors: list[torch.Tensor]):
    """`check(*tensors)`: True only where each tensor has the dtype, device, shape, strides, requires_grad and dispatch
    keys it had here, by torch's C++ check (`tensor_guards`; 40 tensors 2.7 us, 15 us read in Python), which compares
    the thread's autocast and inference mode too (callers compare in full where it says no). None where torch has
    none or it fails on these tensors (one without strides)."""
    try:
        guard = tensor_guards()(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                dynamic_dims_strides=[list(t.stride()) for t in tensors],
                                tensor_check_names=[f"t{i}" for i in range(len(tensors))])
        return guard.check if tensors and guard.check(*tensors) is True else None
    except Exception:       # noqa: BLE001 -- any failure of a private check: compared in full, always right
        return None


def _fields_of(v) -> dict | None:
    """The fields `_value` lists of `v` at depth 0 (a config object's `__dict__`), or None where it lists none."""
    t = type(v)
    if (v is None or t in fp._EXACT or issubclass(t, (*fp._CONTAINERS, *fp._PLAIN, torch.Tensor, torch.nn.Module))
            or callable(v)):
        return None
    fields = getattr(v, "__dict__", None)
    return fields if isinstance(fields, dict) else None


def _flat(v) -> tuple | None:
    """(type, length, elements) of a list, tuple, dict (keys then values) or set (elements by id, and held) of at most
    `fp._LONG` plain values, each by identity (`_kind` 0); None for any other value."""
    t = type(v)
    if t not in _FLAT or len(v) > fp._LONG:
        return None
    items = (*v, *v.values()) if t is dict else tuple(v)
    if not all(_kind(x) == 0 for x in items):
        return None
    return (t, len(v), items) if t in _ORDERED else (t, len(v), (tuple(sorted(map(id, items))), items))


_FLAT, _ORDERED = frozenset({list, tuple, dict, set, frozenset}), frozenset({list, tuple, dict})


def _unchanged(v, flat: tuple) -> bool:
    """`fp._value(v)` is what it was when `_flat` gave `flat`: the same type, length and elements (the same objects)."""
    t, n, items = flat
    if type(v) is not t or len(v) != n:
        return False
    if t is dict:
        return all(map(operator.is_, (*v, *v.values()), items))
    return all(map(operator.is_, v, items)) if t in _ORDERED else tuple(sorted(map(id, v))) == items[0]


def _kind(v) -> int:
    """How `Quick` checks a config's field: 0, by identity (its `_value` at depth 1 is decided by the object: None,
    a number, a string, a tuple of them, another immutable plain value); 1, by identity and staying empty (an empty
    container); 2, again as `_value` gives it."""
    t = type(v)
    if v is None or t in fp._EXACT or (t is tuple and all(x is None or type(x) in fp._EXACT for x in v)):
        return 0
    if issubclass(t, fp._CONTAINERS) and not v:
        return 1
    return 0 if issubclass(t, fp._PLAIN) and not issubclass(t, (list, dict, set)) else 2
_DATA_PTR = torch.Tensor.data_ptr


def _dead():
    class Gone:      # a weak reference whose object is gone: it gives None, as a dict's None entry reads
        pass
    return weakref.ref(Gone())


_DEAD = _dead()


def _own(get, values: list) -> list:
    """What the non-empty `_modules`, `_parameters` and `_buffers` dicts hold, flat, in their order (an OrderedDict's
    own, which `Sequential.insert` makes), from the flat list of attribute values `get` picks them from."""
    return list(itertools.chain.from_iterable(map(_VALUES, get(values)[:-2])))


_VALUES = operator.methodcaller("values")


def _walk(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`list(model.modules())` without building the names: pre-order, each module once."""
    out, seen, stack = [], set(), [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack.extend(reversed([c for c in own_children(m).values() if c is not None]))
    return out


_SHAPE, _DTYPE, _GRAD = operator.attrgetter("shape"), operator.attrgetter("dtype"), operator.attrgetter("requires_grad")
_STRIDE = operator.methodcaller("stride")    # `p.data = p.data.t()` on a square weight: same storage and shape


def _properties(tensors: list, address) -> tuple:
    """What `_tensor` records of each tensor but its id, by C loops: storage address, shape, dtype, requires_grad,
    strides (a tensor without strides raises: the caller takes the full comparison, or no quick check at all)."""
    return (tuple(map(address, tensors)), tuple(map(_SHAPE, tensors)), tuple(map(_DTYPE, tensors)),
            tuple(map(_GRAD, tensors)), tuple(map(_STRIDE, tensors)))

"""nvmeswap's own pickle (Note [own pickle of a plain state]) writes a state's containers,
strings and numbers as this interpreter's C pickler does, protocol 2; with no torch
needed, so on every Python the package claims."""
import collections
import pickle
import random

import pytest

from nvmeswap.checkpoint.plain_pickle import NotPlain, Pickler


def pickled(obj):
    pickler = Pickler()
    pickler.save(obj)
    return bytes(pickler.out + b".")


def random_state(rng):
    made = []

    def value(depth):
        kind = rng.randrange(8 if depth < 4 else 3)
        if kind == 0:
            return rng.randrange(-(1 << 70), 1 << 70) >> rng.randrange(70)
        if kind == 1:
            return rng.choice([rng.random(), "s" * rng.randrange(4), None, True, False,
                               "é\ud800", float("-inf")])
        if kind == 2:
            return rng.choice(made) if made else ""     # met again: the memo
        if kind == 3:
            made.append([value(depth + 1) for _ in range(rng.randrange(5))])
        elif kind == 4:
            made.append(tuple(value(depth + 1) for _ in range(rng.randrange(6))))
        elif kind == 5:
            made.append({rng.choice(["a", "b", 1, 2.5, (1, "t"), None]): value(depth + 1)
                         for _ in range(rng.randrange(5))})
        else:
            made.append(collections.OrderedDict((str(index), value(depth + 1))
                                                for index in range(rng.randrange(4))))
        return made[-1]

    return {"state": value(0)}


def test_random_states_pickle_as_the_c_pickler_pickles_them():
    rng = random.Random(11)
    for _ in range(400):
        state = random_state(rng)
        assert pickled(state) == pickle.dumps(state, protocol=2)


@pytest.mark.parametrize("count", [0, 1, 2, 999, 1000, 1001, 2000, 2001])
def test_batches_of_items_pickle_as_the_c_pickler_pickles_them(count):
    for state in ({index: -index for index in range(count)}, list(range(count)),
                  collections.OrderedDict((str(index), index) for index in range(count))):
        assert pickled(state) == pickle.dumps(state, protocol=2)


def test_an_ordered_dict_with_attributes_and_a_memo_past_256_pickle_as_the_c_pickler():
    ordered = collections.OrderedDict(weight=1, bias=2)
    ordered._metadata = {"": {"version": 1}, "layer": {"version": 2}}
    state = {"ordered": ordered, "many": {f"key {index}": (index,) for index in range(300)}}
    assert pickled(state) == pickle.dumps(state, protocol=2)


@pytest.mark.parametrize("item", [b"bytes", {1, 2}, frozenset(), 1j, bytearray(b"x"),
                                  collections.defaultdict(list), object()],
                         ids=lambda item: type(item).__name__)
def test_anything_else_is_not_plain(item):
    with pytest.raises(NotPlain):
        pickled({"other": [item]})


def test_a_tuple_holding_itself_is_not_plain():
    holder = []
    looped = (holder,)
    holder.append(looped)
    with pytest.raises(NotPlain):
        pickled(looped)

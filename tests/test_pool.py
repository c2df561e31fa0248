"""transport/pool.py: slots, ownership, array views, registered-memory checks."""
import mmap

import numpy as np
import pytest

from transport.errors import PoolExhausted
from transport.pool import ALIGN, BufferPool, Slot, buffer_address, round_up


@pytest.fixture
def pool():
    p = BufferPool(1000, 4, name="t")
    yield p
    p.close()


def test_geometry(pool):
    assert pool.slot_size == 1000 and pool.nslots == 4
    assert pool.stride == round_up(1000) == 1024 and pool.stride % ALIGN == 0
    assert pool.length == 4 * 1024 and pool.memory.nbytes == pool.length
    assert pool.address % ALIGN == 0  # an mmap is page-aligned
    for i in range(4):
        s = pool.slot(i)
        assert s.offset == i * pool.stride and s.capacity == 1000
        assert buffer_address(s.whole) == pool.address + s.offset
        assert buffer_address(s.whole) % ALIGN == 0


def test_alloc_free_cycle(pool):
    slots = [pool.alloc() for _ in range(4)]
    assert sorted(s.index for s in slots) == [0, 1, 2, 3]
    assert pool.available == 0
    for s in slots:
        assert isinstance(s, Slot) and s.nbytes == 1000
    slots[2].release()
    assert pool.available == 1
    again = pool.alloc()
    assert again.index == slots[2].index
    for s in (slots[0], slots[1], slots[3], again):
        pool.free(s.index)
    assert pool.available == 4


def test_alloc_resets_nbytes(pool):
    s = pool.alloc().resize(10)
    s.release()
    for _ in range(4):
        t = pool.alloc()
        assert t.nbytes == 1000


def test_exhaustion(pool):
    held = [pool.alloc() for _ in range(4)]
    assert pool.try_alloc() is None
    with pytest.raises(PoolExhausted):
        pool.alloc()
    held[0].release()
    assert pool.try_alloc() is not None


def test_double_free(pool):
    s = pool.alloc()
    s.release()
    with pytest.raises(ValueError, match="twice"):
        s.release()
    with pytest.raises(ValueError):
        pool.free(s.index)
    assert pool.available == 4  # the refused free changed nothing


def test_free_never_allocated_and_out_of_range(pool):
    with pytest.raises(ValueError):
        pool.free(3)
    for bad in (-1, 4, 100):
        with pytest.raises(ValueError):
            pool.free(bad)


def test_take(pool):
    s = pool.take(2)
    assert s.index == 2 and pool.available == 3
    with pytest.raises(ValueError):
        pool.take(2)
    assert all(pool.alloc().index != 2 for _ in range(3))
    pool.free(2)
    assert pool.alloc().index == 2


def test_slots_do_not_overlap(pool):
    slots = [pool.alloc() for _ in range(4)]
    for i, s in enumerate(slots):
        s.whole[:] = bytes([i + 1]) * s.capacity
    for i, s in enumerate(slots):
        assert bytes(s.whole) == bytes([i + 1]) * 1000
    arrs = [np.frombuffer(s.whole, np.uint8) for s in slots]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not np.shares_memory(arrs[i], arrs[j])


def test_resize_and_buf(pool):
    s = pool.alloc()
    assert s.resize(0).buf.nbytes == 0
    assert s.resize(1000).buf.nbytes == 1000
    with pytest.raises(ValueError):
        s.resize(1001)
    with pytest.raises(ValueError):
        s.resize(-1)
    s.resize(5).buf[:] = b"hello"
    assert bytes(pool.memory[s.offset : s.offset + 5]) == b"hello"


def test_array_views(pool):
    s = pool.alloc()
    a = s.array(np.float32, (10, 20))
    assert a.shape == (10, 20) and a.dtype == np.float32
    assert s.nbytes == 800
    a[:] = np.arange(200, dtype=np.float32).reshape(10, 20)
    assert np.shares_memory(a, np.frombuffer(pool.memory, np.uint8))
    back = np.frombuffer(s.buf, np.float32).reshape(10, 20)
    np.testing.assert_array_equal(back, a)
    assert s.array(np.int64, 5).shape == (5,) and s.nbytes == 40
    assert s.array(np.uint8, ()).shape == () and s.nbytes == 1
    with pytest.raises(ValueError):
        s.array(np.float64, (126,))  # 1008 bytes > 1000
    assert s.array(np.float64, (125,)).nbytes == 1000


def test_contains(pool):
    mem = pool.memory
    assert pool.contains(mem)
    assert pool.contains(mem[10:20])
    assert pool.contains(pool.slot(3).whole)
    assert pool.contains(pool.alloc().array(np.float32, 4))
    assert pool.contains(b"")  # empty buffers are anywhere
    assert not pool.contains(bytearray(100))
    assert not pool.contains(np.zeros(10))
    other = BufferPool(1000, 4)
    assert not pool.contains(other.memory)
    assert not pool.contains(other.slot(0).buf)
    other.close()


def test_contains_straddling():
    backing = mmap.mmap(-1, 8192)
    whole = memoryview(backing)
    p = BufferPool(1024, 2, buffer=whole[1024:])  # the pool is the middle of a bigger region
    assert p.contains(whole[1024 : 1024 + 2048])
    assert not p.contains(whole[1000:1100])  # starts before
    assert not p.contains(whole[2000 + 1024 : 3100 + 1024])  # ends after
    assert not p.contains(whole[:1024])
    p.close()
    whole.release()


def test_contains_strided_views(pool):
    a = np.frombuffer(pool.memory, dtype=np.uint8)
    assert pool.contains(a[::2])
    assert pool.contains(a.reshape(4, -1)[:, :10])
    assert pool.contains(memoryview(pool.memory)[::3])
    outside = np.zeros(100, np.uint8)
    assert not pool.contains(outside[::2])


def test_view_bounds(pool):
    v = pool.view(1, 10, 20)
    assert v.nbytes == 20
    assert buffer_address(v) == pool.address + pool.stride + 10
    assert pool.view(1).nbytes == 1000
    with pytest.raises(ValueError):
        pool.view(1, 990, 20)
    with pytest.raises(ValueError):
        pool.view(1, -1, 5)
    with pytest.raises(ValueError):
        pool.view(1, 10, -5)


def test_external_buffer():
    buf = bytearray(4 * 128)
    p = BufferPool(100, 4, buffer=buf)
    s = p.alloc()
    s.resize(3).buf[:] = b"abc"
    assert bytes(buf[s.offset : s.offset + 3]) == b"abc"
    assert p.contains(memoryview(buf)[s.offset : s.offset + 3])
    with pytest.raises(ValueError):
        BufferPool(100, 5, buffer=bytearray(4 * 128))  # too small


def test_bad_geometry():
    for size, n in ((0, 1), (1, 0), (-5, 3)):
        with pytest.raises(ValueError):
            BufferPool(size, n)


def test_close_with_a_view_outstanding():
    p = BufferPool(4096, 2)
    arr = p.alloc().array(np.uint8, 100)
    p.close()  # must not raise while a caller still holds a view
    arr[:] = 1  # the mapping lives as long as the view does
    assert arr.sum() == 100


def test_try_alloc_sizes_and_put_gives_back_lifo():
    p = BufferPool(256, 4)
    a = p.try_alloc(10)
    assert a.nbytes == 10 and p.available == 3
    with pytest.raises(ValueError):
        p.try_alloc(257)
    assert p.available == 3  # a refused size takes nothing
    assert p.put(a) is True and p.put(a) is False  # the owner's give-back is idempotent
    assert p.try_alloc().index == a.index  # last freed, first reused
    while p.try_alloc() is not None:
        pass
    assert p.available == 0 and p.try_alloc(1) is None

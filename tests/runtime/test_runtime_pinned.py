"""Pinned host arrays (Device.alloc_host): uploads from them are one DMA, no staging."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from guest_driver import uapi
from userspace_runtime import CommandBufferBuilder, Device, DeviceError

import rt_stack


def run_guest(program: Any) -> Any:
    return rt_stack.run_guest(program, 11, "pinned-test")


def test_pinned_upload_equals_staged_upload_without_staging() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 16), dtype=np.float32)
    x = rng.standard_normal((8, 32), dtype=np.float32)
    bias = rng.standard_normal(16, dtype=np.float32)

    def program(os_: uapi.GuestOS) -> dict[str, Any]:
        with Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            bx, bw, bb, by = (ctx.alloc(x.shape), ctx.alloc(w.shape), ctx.alloc(bias.shape),
                              ctx.alloc((8, 16)))
            px, pw = dev.alloc_host(x.shape), dev.alloc_host(w.shape)
            assert px.dtype == np.float32 and not px.any()
            px[...] = x
            pw[...] = w
            allocs: list[int] = []
            real_alloc = s._staging.alloc
            s._staging.alloc = lambda n, seq: allocs.append(n) or real_alloc(n, seq)  # type: ignore[method-assign]
            s.upload(bx, px)
            s.upload(bw, pw)
            pinned_staging = sum(allocs)
            s._staging.alloc = real_alloc  # type: ignore[method-assign]
            s.upload(bb, bias)  # an ordinary array: staged
            s.gemm(bx, bw, by, bias=bb, activation="relu")
            y_pinned = s.download(by)
            s.synchronize()
            # the same through staging
            s.upload(bx, x.copy())
            s.upload(bw, w.copy())
            s.gemm(bx, bw, by, bias=bb, activation="relu")
            y_staged = s.download(by)
            s.synchronize()
            # a C-contiguous sub-view of a pinned array is pinned too
            sub = dev.alloc_host((2, 8, 32))
            sub[1] = x
            s.upload(bx, sub[1])
            s.gemm(bx, bw, by, bias=bb, activation="relu")
            y_sub = s.download(by)
            s.synchronize()
            dev.free_host(sub)
            with pytest.raises(ValueError):
                dev.free_host(x)
            return {"pinned": y_pinned.result(), "staged": y_staged.result(),
                    "sub": y_sub.result(), "pinned_staging": pinned_staging}

    r = run_guest(program)
    want = np.maximum(x @ w + bias, 0)
    np.testing.assert_array_equal(r["pinned"], r["staged"])
    np.testing.assert_array_equal(r["sub"], r["staged"])
    np.testing.assert_allclose(r["pinned"], want, rtol=1e-5, atol=1e-5)
    assert r["pinned_staging"] == 0


def test_non_contiguous_pinned_view_goes_through_staging() -> None:
    def program(os_: uapi.GuestOS) -> np.ndarray:
        with Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            p = dev.alloc_host((4, 4))
            p[...] = np.arange(16, dtype=np.float32).reshape(4, 4)
            b = ctx.alloc((4, 4))
            s.upload(b, p.T)  # not C-contiguous: copied into staging, as before
            p[...] = -1  # too late to matter for a staged upload
            out = s.download(b)
            s.synchronize()
            return out.result()
    got = run_guest(program)
    np.testing.assert_array_equal(got, np.arange(16, dtype=np.float32).reshape(4, 4).T)


def test_freed_pinned_array_is_no_longer_pinned() -> None:
    """Uploads look pinned arrays up by identity: free_host must drop that entry, so
    the freed array (still alive in the caller) goes through staging from then on."""
    def program(os_: uapi.GuestOS) -> tuple[Any, Any, Any]:
        with Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            p = dev.alloc_host((4, 4))
            p[...] = 3.0
            before = dev._pinned_iova(p)
            dev.free_host(p)
            after = dev._pinned_iova(p)
            b = ctx.alloc((4, 4))
            allocs: list[int] = []
            real_alloc = s._staging.alloc
            s._staging.alloc = lambda n, seq: allocs.append(n) or real_alloc(n, seq)  # type: ignore[method-assign]
            s.upload(b, p)
            s._staging.alloc = real_alloc  # type: ignore[method-assign]
            s.synchronize()
            return before, after, allocs
    before, after, allocs = run_guest(program)
    assert before is not None and after is None
    assert allocs == [64]


def test_download_into_pinned_out_is_one_dma_without_staging() -> None:
    x = np.random.default_rng(3).standard_normal((8, 16), dtype=np.float32)

    def program(os_: uapi.GuestOS) -> dict[str, Any]:
        with Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            b = ctx.alloc(x.shape)
            s.upload(b, x)
            out = dev.alloc_host((2, 8, 16))
            allocs: list[int] = []
            real_alloc = s._staging.alloc
            s._staging.alloc = lambda n, seq: allocs.append(n) or real_alloc(n, seq)  # type: ignore[method-assign]
            p = s.download(b, out=out[1])
            staged_bytes = sum(allocs)
            s._staging.alloc = real_alloc  # type: ignore[method-assign]
            cmds = s.disassemble()
            done_before = p.done()
            s.synchronize()
            got = p.result()
            return {"got": got, "is_view": np.shares_memory(got, out), "out": out.copy(),
                    "staged": staged_bytes, "cmds": cmds, "done_before": done_before,
                    "done_after": p.done()}

    r = run_guest(program)
    assert r["staged"] == 0
    assert "download pinned" in r["cmds"]
    assert r["is_view"] and r["done_after"]
    np.testing.assert_array_equal(r["got"], x)
    np.testing.assert_array_equal(r["out"][1], x)
    assert not r["out"][0].any()   # nothing outside the view was written


def test_download_into_pinned_out_reports_a_failed_submission() -> None:
    """A pinned download in a submission the device fails raises the device's error
    from result(); its array is not handed out."""
    def program(os_: uapi.GuestOS) -> tuple[str, bool]:
        with Device(os_) as dev:
            mem = dev.params["device_memory_size"]
            ctx = dev.create_context()
            s = ctx.create_stream()
            b = ctx.alloc((16,))
            out = dev.alloc_host((16,))
            bad = CommandBufferBuilder()
            bad.gemm(dtype="f32", m=4, n=4, k=4, a=b.addr, b=b.addr, c=mem - 16,
                     name="gemm writing past device memory")
            s.enqueue(bad, [b])
            p = s.download(b, out=out)
            with pytest.raises(DeviceError):
                s.synchronize()
            with pytest.raises(DeviceError) as ei:
                p.result()
            return str(ei.value), p.done()

    msg, done = run_guest(program)
    assert "gemm writing past device memory" in msg and done

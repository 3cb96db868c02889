"""The guest side of the console's X calls (``capsule.console.guestx``): the clipboard's selections, the screen's
size and the pointer, shipped to the guest as source and run there by ``python3 -`` (the source on its stdin)
through the guest agent's ``exec``. It needs only Python's standard library, libX11 and, for the size, libXrandr
(any guest with an X session has them): no guest image carries it.

It runs as root (the agent's ``exec``), takes the display's owner from the X socket and runs as that user,
with that user's X cookie::

    get MAX            the clipboard's text on stdout, base64; at most MAX bytes (exit 3 beyond)
    set FILE           FILE (base64, written by the host) becomes the CLIPBOARD and PRIMARY selections: a
                       background process owns them until another program takes both
    pointer            where the X pointer is: "X Y" on the screen (what `xdotool getmouselocation` says)
    size W H           the screen's resolution becomes W x H (within what the X server allows; a mode made for
                       it where the output has none), as `xrandr --output O --mode WxH` does: "W H" set; a
                       mode the X server refuses leaves the screen as it was (exit 5)

``get`` reads CLIPBOARD, or PRIMARY where that is newer: when nothing owns CLIPBOARD, or when this helper
owns it and another program has taken PRIMARY since (text selected in a terminal). Exit codes: 0 done,
3 too large, 4 no X session, 5 the owner did not answer. This module is never imported by the host."""

from __future__ import annotations

import base64
import ctypes
import os
import pwd
import select
import sys
import time

DISPLAY = ":0"
SOCKET = "/tmp/.X11-unix/X0"
MARK = b"_CAPSULE_CLIPBOARD"       # a property on the helper's own window: who owns a selection
TOO_LARGE, NO_SESSION, NO_ANSWER = 3, 4, 5
SELECTION_CLEAR, SELECTION_REQUEST, SELECTION_NOTIFY = 29, 30, 31
XA_ATOM = 4
ANSWER_WAIT = 5.0

ulong, Atom, Window = ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong


class SelectionRequest(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("serial", ulong), ("send_event", ctypes.c_int),
                ("display", ctypes.c_void_p), ("owner", Window), ("requestor", Window), ("selection", Atom),
                ("target", Atom), ("property", Atom), ("time", ulong)]


class SelectionNotify(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("serial", ulong), ("send_event", ctypes.c_int),
                ("display", ctypes.c_void_p), ("requestor", Window), ("selection", Atom), ("target", Atom),
                ("property", Atom), ("time", ulong)]


class SelectionClear(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("serial", ulong), ("send_event", ctypes.c_int),
                ("display", ctypes.c_void_p), ("window", Window), ("selection", Atom), ("time", ulong)]


class Event(ctypes.Union):
    _fields_ = [("type", ctypes.c_int), ("request", SelectionRequest), ("notify", SelectionNotify),
                ("clear", SelectionClear), ("pad", ctypes.c_long * 24)]


def fail(code: int, message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.exit(code)


def become_session_user() -> None:
    """Run as the user whose X server listens on the display's socket, with that user's cookie."""
    try:
        uid = os.stat(SOCKET).st_uid
    except OSError:
        fail(NO_SESSION, f"no X session in the guest ({SOCKET} is missing)")
    os.environ["DISPLAY"] = DISPLAY
    if uid == 0 or os.getuid() != 0:
        return
    user = pwd.getpwuid(uid)
    os.environ.update(HOME=user.pw_dir, USER=user.pw_name, XAUTHORITY=os.path.join(user.pw_dir, ".Xauthority"))
    os.setgroups([])
    os.setgid(user.pw_gid)
    os.setuid(uid)


class X:
    def __init__(self) -> None:
        self.lib = lib = ctypes.CDLL("libX11.so.6")
        lib.XOpenDisplay.restype = ctypes.c_void_p
        lib.XOpenDisplay.argtypes = [ctypes.c_char_p]
        lib.XDefaultRootWindow.restype = Window
        lib.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        lib.XQueryPointer.argtypes = [ctypes.c_void_p, Window, *[ctypes.c_void_p] * 7]
        lib.XCreateSimpleWindow.restype = Window
        lib.XCreateSimpleWindow.argtypes = [ctypes.c_void_p, Window, ctypes.c_int, ctypes.c_int, ctypes.c_uint,
                                            ctypes.c_uint, ctypes.c_uint, ulong, ulong]
        lib.XInternAtom.restype = Atom
        lib.XInternAtom.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib.XGetSelectionOwner.restype = Window
        lib.XGetSelectionOwner.argtypes = [ctypes.c_void_p, Atom]
        lib.XSetSelectionOwner.argtypes = [ctypes.c_void_p, Atom, Window, ulong]
        lib.XConvertSelection.argtypes = [ctypes.c_void_p, Atom, Atom, Atom, Window, ulong]
        lib.XChangeProperty.argtypes = [ctypes.c_void_p, Window, Atom, Atom, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_void_p, ctypes.c_int]
        lib.XGetWindowProperty.argtypes = [ctypes.c_void_p, Window, Atom, ctypes.c_long, ctypes.c_long,
                                           ctypes.c_int, Atom, ctypes.POINTER(Atom), ctypes.POINTER(ctypes.c_int),
                                           ctypes.POINTER(ulong), ctypes.POINTER(ulong),
                                           ctypes.POINTER(ctypes.c_void_p)]
        lib.XSendEvent.argtypes = [ctypes.c_void_p, Window, ctypes.c_int, ctypes.c_long, ctypes.POINTER(Event)]
        lib.XNextEvent.argtypes = [ctypes.c_void_p, ctypes.POINTER(Event)]
        lib.XPending.argtypes = [ctypes.c_void_p]
        lib.XConnectionNumber.argtypes = [ctypes.c_void_p]
        lib.XFlush.argtypes = [ctypes.c_void_p]
        lib.XFree.argtypes = [ctypes.c_void_p]
        # an X error (a requestor window gone) must not end the helper: Xlib's default handler exits
        self._on_error = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(lambda d, e: 0)
        lib.XSetErrorHandler(self._on_error)
        self.dpy = lib.XOpenDisplay(None)
        if not self.dpy:
            fail(NO_SESSION, f"cannot open the X display {DISPLAY} as {pwd.getpwuid(os.getuid()).pw_name}")
        self.window = lib.XCreateSimpleWindow(self.dpy, lib.XDefaultRootWindow(self.dpy), 0, 0, 1, 1, 0, 0, 0)

    def atom(self, name: bytes) -> int:
        return int(self.lib.XInternAtom(self.dpy, name, 0))

    def prop(self, window: int, prop: int, max_bytes: int, delete: bool = False) -> tuple[int, bytes, int]:
        """(type, the value's bytes, bytes left unread) of a window's property."""
        kind, fmt, n, after, data = Atom(), ctypes.c_int(), ulong(), ulong(), ctypes.c_void_p()
        self.lib.XGetWindowProperty(self.dpy, window, prop, 0, max_bytes // 4 + 1, int(delete), 0,
                                    ctypes.byref(kind), ctypes.byref(fmt), ctypes.byref(n), ctypes.byref(after),
                                    ctypes.byref(data))
        if not data.value:
            return int(kind.value), b"", 0
        size = n.value * {8: 1, 16: 2, 32: ctypes.sizeof(ctypes.c_long)}.get(fmt.value, 1)
        value = ctypes.string_at(data.value, size)
        self.lib.XFree(data)
        return int(kind.value), value, int(after.value)

    def wait(self, event: Event, kind: int, deadline: float) -> bool:
        fd = self.lib.XConnectionNumber(self.dpy)
        while True:
            while self.lib.XPending(self.dpy):
                self.lib.XNextEvent(self.dpy, ctypes.byref(event))
                if event.type == kind:
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([fd], [], [], left)


def get(max_bytes: int) -> None:
    x = X()
    clipboard, primary = x.atom(b"CLIPBOARD"), x.atom(b"PRIMARY")
    mark = x.atom(MARK)

    def ours(owner: int) -> bool:
        return owner != 0 and x.prop(owner, mark, 4)[0] != 0

    owner = x.lib.XGetSelectionOwner(x.dpy, clipboard)
    other = x.lib.XGetSelectionOwner(x.dpy, primary)
    selection = primary if (owner == 0 or ours(owner)) and other != 0 and not ours(other) else clipboard
    if x.lib.XGetSelectionOwner(x.dpy, selection) == 0:
        sys.stdout.write("")
        return
    target, into = x.atom(b"UTF8_STRING"), x.atom(b"CAPSULE_CLIP")
    x.lib.XConvertSelection(x.dpy, selection, target, into, x.window, 0)
    x.lib.XFlush(x.dpy)
    event = Event()
    if not x.wait(event, SELECTION_NOTIFY, time.monotonic() + ANSWER_WAIT):
        fail(NO_ANSWER, f"the program owning the guest's clipboard did not answer in {ANSWER_WAIT:.0f} s")
    if event.notify.property == 0:
        sys.stdout.write("")        # the owner has no text to give
        return
    kind, value, after = x.prop(x.window, into, max_bytes, delete=True)
    if kind == x.atom(b"INCR") or after > 0 or len(value) > max_bytes:
        fail(TOO_LARGE, f"the guest's clipboard holds more than {max_bytes} bytes")
    sys.stdout.write(base64.b64encode(value).decode())


def serve(x: X, data: bytes) -> None:
    """Own CLIPBOARD and PRIMARY and answer requests for them until another program has taken both."""
    selections = {x.atom(b"CLIPBOARD"), x.atom(b"PRIMARY")}
    targets_atom = x.atom(b"TARGETS")
    texts = [x.atom(b"UTF8_STRING"), x.atom(b"STRING"), x.atom(b"TEXT"), x.atom(b"text/plain;charset=utf-8")]
    buf = ctypes.create_string_buffer(data, len(data))
    event = Event()
    while selections:
        x.lib.XNextEvent(x.dpy, ctypes.byref(event))
        if event.type == SELECTION_CLEAR:
            selections.discard(event.clear.selection)
        elif event.type == SELECTION_REQUEST:
            req = event.request
            prop = req.property or req.target
            if req.target == targets_atom:
                atoms = (Atom * (len(texts) + 1))(targets_atom, *texts)
                x.lib.XChangeProperty(x.dpy, req.requestor, prop, XA_ATOM, 32, 0, atoms, len(texts) + 1)
            elif req.target in texts:
                x.lib.XChangeProperty(x.dpy, req.requestor, prop, req.target, 8, 0, buf, len(data))
            else:
                prop = 0
            answer = Event()
            answer.notify = SelectionNotify(SELECTION_NOTIFY, 0, 1, x.dpy, req.requestor, req.selection,
                                            req.target, prop, req.time)
            x.lib.XSendEvent(x.dpy, req.requestor, 0, 0, ctypes.byref(answer))
            x.lib.XFlush(x.dpy)


def set_(path: str) -> None:
    with open(path, "rb") as f:
        data = base64.b64decode(f.read(), validate=True)
    os.unlink(path)
    become_session_user()
    x = X()
    x.lib.XChangeProperty(x.dpy, x.window, x.atom(MARK), XA_ATOM, 32, 0, (Atom * 1)(0), 1)
    for name in (b"CLIPBOARD", b"PRIMARY"):
        x.lib.XSetSelectionOwner(x.dpy, x.atom(name), x.window, 0)
        if x.lib.XGetSelectionOwner(x.dpy, x.atom(name)) != x.window:
            fail(NO_ANSWER, f"the X server did not give this helper the {name.decode()} selection")
    x.lib.XFlush(x.dpy)
    if os.fork():
        os._exit(0)      # the agent's exec returns; the child keeps the selections
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    serve(x, data)
    os._exit(0)


def pointer() -> None:
    x = X()
    root, child = Window(), Window()
    rx, ry, wx, wy, mask = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_uint()
    x.lib.XQueryPointer(x.dpy, x.lib.XDefaultRootWindow(x.dpy), ctypes.byref(root), ctypes.byref(child),
                        ctypes.byref(rx), ctypes.byref(ry), ctypes.byref(wx), ctypes.byref(wy), ctypes.byref(mask))
    sys.stdout.write(f"{rx.value} {ry.value}\n")


class ModeInfo(ctypes.Structure):
    _fields_ = [("id", ulong), ("width", ctypes.c_uint), ("height", ctypes.c_uint), ("dotClock", ulong),
                ("hSyncStart", ctypes.c_uint), ("hSyncEnd", ctypes.c_uint), ("hTotal", ctypes.c_uint),
                ("hSkew", ctypes.c_uint), ("vSyncStart", ctypes.c_uint), ("vSyncEnd", ctypes.c_uint),
                ("vTotal", ctypes.c_uint), ("name", ctypes.c_char_p), ("nameLength", ctypes.c_uint),
                ("modeFlags", ulong)]


class Resources(ctypes.Structure):
    _fields_ = [("timestamp", ulong), ("configTimestamp", ulong), ("ncrtc", ctypes.c_int),
                ("crtcs", ctypes.POINTER(ulong)), ("noutput", ctypes.c_int), ("outputs", ctypes.POINTER(ulong)),
                ("nmode", ctypes.c_int), ("modes", ctypes.POINTER(ModeInfo))]


class OutputInfo(ctypes.Structure):
    _fields_ = [("timestamp", ulong), ("crtc", ulong), ("name", ctypes.c_char_p), ("nameLen", ctypes.c_int),
                ("mm_width", ulong), ("mm_height", ulong), ("connection", ctypes.c_ushort),
                ("subpixel_order", ctypes.c_ushort), ("ncrtc", ctypes.c_int), ("crtcs", ctypes.POINTER(ulong)),
                ("nclone", ctypes.c_int), ("clones", ctypes.POINTER(ulong)), ("nmode", ctypes.c_int),
                ("npreferred", ctypes.c_int), ("modes", ctypes.POINTER(ulong))]


class CrtcInfo(ctypes.Structure):
    _fields_ = [("timestamp", ulong), ("x", ctypes.c_int), ("y", ctypes.c_int), ("width", ctypes.c_uint),
                ("height", ctypes.c_uint), ("mode", ulong), ("rotation", ctypes.c_ushort), ("noutput", ctypes.c_int),
                ("outputs", ctypes.POINTER(ulong)), ("rotations", ctypes.c_ushort), ("npossible", ctypes.c_int),
                ("possible", ctypes.POINTER(ulong))]


def size(width: int, height: int) -> None:
    x = X()
    rr = ctypes.CDLL("libXrandr.so.2")
    root = x.lib.XDefaultRootWindow(x.dpy)
    rr.XRRGetScreenResourcesCurrent.restype = ctypes.POINTER(Resources)
    rr.XRRGetScreenResourcesCurrent.argtypes = [ctypes.c_void_p, Window]
    rr.XRRGetOutputInfo.restype = ctypes.POINTER(OutputInfo)
    rr.XRRGetOutputInfo.argtypes = [ctypes.c_void_p, ctypes.POINTER(Resources), ulong]
    rr.XRRGetScreenSizeRange.argtypes = [ctypes.c_void_p, Window, *[ctypes.POINTER(ctypes.c_int)] * 4]
    rr.XRRCreateMode.restype = ulong
    rr.XRRCreateMode.argtypes = [ctypes.c_void_p, Window, ctypes.POINTER(ModeInfo)]
    rr.XRRAddOutputMode.argtypes = [ctypes.c_void_p, ulong, ulong]
    rr.XRRSetScreenSize.argtypes = [ctypes.c_void_p, Window, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    rr.XRRSetCrtcConfig.argtypes = [ctypes.c_void_p, ctypes.POINTER(Resources), ulong, ulong, ctypes.c_int,
                                    ctypes.c_int, ulong, ctypes.c_ushort, ctypes.POINTER(ulong), ctypes.c_int]
    rr.XRRFreeOutputInfo.argtypes = [ctypes.POINTER(OutputInfo)]
    rr.XRRGetCrtcInfo.restype = ctypes.POINTER(CrtcInfo)
    rr.XRRGetCrtcInfo.argtypes = [ctypes.c_void_p, ctypes.POINTER(Resources), ulong]
    rr.XRRFreeCrtcInfo.argtypes = [ctypes.POINTER(CrtcInfo)]
    for f in ("XDisplayWidth", "XDisplayHeight", "XDisplayWidthMM", "XDisplayHeightMM"):
        getattr(x.lib, f).argtypes = [ctypes.c_void_p, ctypes.c_int]
    rr.XRRFreeScreenResources.argtypes = [ctypes.POINTER(Resources)]
    x.lib.XSync.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lo_w, lo_h, hi_w, hi_h = (ctypes.c_int() for _ in range(4))
    rr.XRRGetScreenSizeRange(x.dpy, root, ctypes.byref(lo_w), ctypes.byref(lo_h), ctypes.byref(hi_w),
                             ctypes.byref(hi_h))
    width, height = max(lo_w.value, min(width, hi_w.value)), max(lo_h.value, min(height, hi_h.value))

    res = rr.XRRGetScreenResourcesCurrent(x.dpy, root)
    output = crtc = 0
    for i in range(res.contents.noutput):
        info = rr.XRRGetOutputInfo(x.dpy, res, res.contents.outputs[i])
        if info.contents.connection == 0 and info.contents.crtc:
            output, crtc = res.contents.outputs[i], info.contents.crtc
            has = {info.contents.modes[j] for j in range(info.contents.nmode)}
        rr.XRRFreeOutputInfo(info)
        if output:
            break
    if not output:
        fail(NO_SESSION, "the X screen has no connected output to resize")
    mode = next((m.id for m in (res.contents.modes[j] for j in range(res.contents.nmode))
                 if (m.width, m.height) == (width, height) and m.id in has), 0)
    if not mode:
        name = f"{width}x{height}".encode()
        info = ModeInfo(0, width, height, (width + 160) * (height + 30) * 60, width + 48, width + 80, width + 160, 0,
                        height + 3, height + 9, height + 30, name, len(name), 0)
        mode = rr.XRRCreateMode(x.dpy, root, ctypes.byref(info))
        rr.XRRAddOutputMode(x.dpy, output, mode)
        x.lib.XSync(x.dpy, 0)
        rr.XRRFreeScreenResources(res)
        res = rr.XRRGetScreenResourcesCurrent(x.dpy, root)
    # what the screen shows now: put back if the new mode is refused (else the output stays off, the screen dark)
    was = rr.XRRGetCrtcInfo(x.dpy, res, crtc)
    old_mode, old_rotation = was.contents.mode, was.contents.rotation
    rr.XRRFreeCrtcInfo(was)
    old_size = [getattr(x.lib, f)(x.dpy, 0) for f in ("XDisplayWidth", "XDisplayHeight", "XDisplayWidthMM",
                                                       "XDisplayHeightMM")]
    # as xrandr does: the CRTC off, the screen to its new size, the CRTC on in the new mode (96 dpi)
    rr.XRRSetCrtcConfig(x.dpy, res, crtc, 0, 0, 0, 0, 1, None, 0)
    rr.XRRSetScreenSize(x.dpy, root, width, height, width * 254 // 960, height * 254 // 960)
    outputs = (ulong * 1)(output)
    status = rr.XRRSetCrtcConfig(x.dpy, res, crtc, 0, 0, 0, mode, 1, outputs, 1)
    if status != 0:
        rr.XRRSetScreenSize(x.dpy, root, *old_size)
        rr.XRRSetCrtcConfig(x.dpy, res, crtc, 0, 0, 0, old_mode, old_rotation, outputs, 1)
    x.lib.XSync(x.dpy, 0)
    rr.XRRFreeScreenResources(res)
    if status != 0:
        fail(NO_ANSWER, f"the X server refused the mode {width}x{height} (status {status}): the screen keeps its "
                        f"{old_size[0]}x{old_size[1]}")
    sys.stdout.write(f"{width} {height}\n")


def main(argv: list[str]) -> None:
    if argv[:1] == ["size"] and len(argv) == 3:
        become_session_user()
        size(int(argv[1]), int(argv[2]))
    elif argv == ["pointer"]:
        become_session_user()
        pointer()
    elif argv[:1] == ["get"] and len(argv) == 2:
        become_session_user()
        get(int(argv[1]))
    elif argv[:1] == ["set"] and len(argv) == 2:
        set_(argv[1])
    else:
        fail(2, "usage: get MAX | set FILE | pointer | size W H")


if __name__ == "__main__":
    main(sys.argv[1:])

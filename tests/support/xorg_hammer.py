"""Update a tray icon on pystray's xorg backend from several threads while its loop redraws.

``python -m tests.support.xorg_hammer UPDATES`` (DISPLAY set, a tray running): three threads
each set the icon and the title UPDATES times while a fourth keeps asking the X server to
expose the icon's window, so the loop is busy with its own requests (an expose redraws, which
waits for replies) whenever an update is handed to it. Prints ``updates: N`` and exits 0 when
every update ran; a hang is the caller's timeout.
"""

from __future__ import annotations

import sys
import threading

from PIL import Image

THREADS = 3


def main(updates: int) -> int:
    import Xlib.display

    from meshd.app.xorg_icon import ThreadSafeXorgIcon

    images = [Image.new("RGB", (32, 32), colour) for colour in ("red", "green", "blue")]
    icon = ThreadSafeXorgIcon("meshd-hammer", images[0], "hammer")
    done = threading.Event()
    counts = [0] * THREADS

    def update(index: int) -> None:
        for step in range(updates):
            icon.icon = images[(index + step) % len(images)]
            icon.title = f"hammer {index} {step}"
            counts[index] += 1

    def expose() -> None:
        display = Xlib.display.Display()
        window = display.create_resource_object("window", icon._window.id)
        while not done.wait(0.002):
            window.clear_area(exposures=True)
            display.flush()
        display.close()

    def setup(icon: ThreadSafeXorgIcon) -> None:
        icon.visible = True
        exposer = threading.Thread(target=expose)
        exposer.start()
        workers = [threading.Thread(target=update, args=(index,)) for index in range(THREADS)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        done.set()
        exposer.join()
        icon.stop()

    icon.run(setup)
    print(f"updates: {sum(counts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))

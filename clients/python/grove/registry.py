"""`grove.registry.pull(reference, ...)`: a registry pull as a plain dict (the image's info); the same as
`grove.Image.pull(...).info` (and `apull` as `AsyncImage.pull`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from .images import AsyncImage, Image

PullCallback = Callable[[dict], None]


def pull(reference: str, *, name: Optional[str] = None, platform: Optional[str] = None,
         on_event: Optional[PullCallback] = None, client: Any = None) -> dict:
    """Pulls `reference` into the node's store; returns the image (name, root, size_bytes, config)."""
    return Image.pull(reference, name=name, platform=platform, on_event=on_event, client=client).info


async def apull(reference: str, *, name: Optional[str] = None, platform: Optional[str] = None,
                on_event: Optional[PullCallback] = None, client: Any = None) -> dict:
    """`pull` for asyncio."""
    img = await AsyncImage.pull(reference, name=name, platform=platform, on_event=on_event, client=client)
    return img.info

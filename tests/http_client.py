"""One shared HTTP client for the tests' plain requests.

httpx's module-level ``httpx.get``/``post`` build a client per call, and with it an SSL
context from the CA bundle: about 60 ms of CPU each on these machines, and a fleet test
makes hundreds. The shared client keeps no cookies, so every request stays as anonymous
as a module-level one was.
"""

from __future__ import annotations

import functools
from http import cookiejar

import httpx


@functools.cache
def web() -> httpx.Client:
    refuse_all = cookiejar.DefaultCookiePolicy(allowed_domains=[])
    return httpx.Client(cookies=httpx.Cookies(cookiejar.CookieJar(policy=refuse_all)))

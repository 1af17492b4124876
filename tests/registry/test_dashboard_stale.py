"""When the dashboard's live feed fails, the page says so (issue 40, item 8): in a real headless Chromium, the
registry process stopped under an open page greys the figures, a banner says they are "as of" a time, and both
go once the registry answers again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.registry_helpers import ADMIN_TOKEN, Keys, RegistryServer, headless_chromium, wait_for


@pytest.fixture
def browser() -> Iterator[Any]:
    with headless_chromium(1280, 900) as driver:
        yield driver


@pytest.mark.slow  # a browser and two registry starts (~13 s); test_rollout_record.py holds the rest of item 8
def test_a_failing_live_feed_greys_the_page_and_says_as_of_when(tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    server = RegistryServer(tmp_path, [Keys.make(tmp_path).public], extra_args=["--dashboard-poll", "1s"]).start()
    try:
        d = browser
        d.get(server.url + "/ui/login")
        d.find_element(By.ID, "token").send_keys(ADMIN_TOKEN)
        d.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
        wait_for(lambda: d.current_url.endswith("/ui/fleet"), 30, 0.2, "the fleet page")
        banner = d.find_element(By.ID, "stale-banner")
        live = d.find_element(By.ID, "live")
        wait_for(lambda: int(live.get_attribute("data-polls") or 0) >= 1, 30, 0.2, "a live update")
        assert not banner.is_displayed() and "stale" not in (live.get_attribute("class") or "")

        server.stop()  # the registry goes away under the open page
        wait_for(banner.is_displayed, 30, 0.2, "the stale banner")
        assert "as of" in banner.text and "not current" in banner.text, banner.text
        assert "stale" in (live.get_attribute("class") or "")
        assert float(d.execute_script("return getComputedStyle(arguments[0]).opacity", live)) < 1

        server.start()  # back on the same port: the next update clears both
        wait_for(lambda: not banner.is_displayed(), 60, 0.2, "the banner to go")
        assert "stale" not in (live.get_attribute("class") or "")
    finally:
        server.stop()

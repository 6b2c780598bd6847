"""report.html in a real browser: headless Chromium (Debian's `chromium` + `chromium-driver`) driven by Selenium.

`make install-browser` (a dependency of `make test`) installs both. The report is generated from synthetic
trajectories built with the tiny tokenizer, so the test needs no model.
"""

import shutil
from pathlib import Path

import pytest
from report_helpers import synthetic_trajectories

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail("Chromium and chromedriver are missing: run `make install-browser`.")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
        "--window-size=1200,900",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def report(tiny_tokenizer, tmp_path_factory):
    from trl_agentic.reporting import write_report

    trajectories = synthetic_trajectories(tiny_tokenizer)
    path = write_report(
        tmp_path_factory.mktemp("report") / "report.html",
        trajectories,
        eval_results={"before GRPO": {"success_rate": 0.25}, "after GRPO": {"success_rate": 0.5}},
    )
    return path, trajectories


def test_trajectories_render(browser, report):
    from selenium.webdriver.common.by import By

    path, trajectories = report
    browser.get(path.as_uri())
    articles = browser.find_elements(By.CSS_SELECTOR, "article.trajectory")
    assert len(articles) == len(trajectories)
    assert all(a.is_displayed() for a in articles)
    # A rollback badge, a negative sample and a snapshot are visible.
    badge = browser.find_element(By.CSS_SELECTOR, ".badge-rollback")
    assert badge.is_displayed() and badge.text == "rollback ×1"
    assert browser.find_element(By.CSS_SELECTOR, ".badge-negative").is_displayed()
    assert browser.find_element(By.CSS_SELECTOR, ".badge-snapshot").is_displayed()
    # The tool call of the first trajectory is shown as text, and its tokens carry their advantage.
    first = articles[0]
    call = first.find_element(By.CSS_SELECTOR, ".tool-call")
    assert call.text == 'tool call → calculate(expression="12 * 3")'
    token = first.find_element(By.CSS_SELECTOR, ".tok")
    assert token.get_attribute("title").startswith("advantage +0.300")
    assert "rgba(46, 160, 67" in token.value_of_css_property("background-color").replace(
        "rgba(46,160,67", "rgba(46, 160, 67"
    )
    # Tool results render, an error in its own style; a further user message is shown as one.
    assert browser.find_elements(By.CSS_SELECTOR, ".turn-env.tool-error")
    users = browser.find_elements(By.CSS_SELECTOR, ".turn-env.turn-user")
    assert users and all(u.is_displayed() and "Now double it." in u.text for u in users)
    assert users[0].find_element(By.CSS_SELECTOR, ".turn-label").text.lower().startswith("user message")
    # The script ran: it wrote the count.
    assert (
        browser.find_element(By.ID, "shown-count").text
        == f"{len(trajectories)} of {len(trajectories)} trajectories shown"
    )


def test_filters_hide_and_show_trajectories(browser, report):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    path, trajectories = report
    browser.get(path.as_uri())
    Select(browser.find_element(By.ID, "filter-kind")).select_by_value("negative")
    visible = [a for a in browser.find_elements(By.CSS_SELECTOR, "article.trajectory") if a.is_displayed()]
    assert len(visible) == sum(t["kind"] == "negative" for t in trajectories)
    assert all(a.get_attribute("data-kind") == "negative" for a in visible)
    Select(browser.find_element(By.ID, "filter-kind")).select_by_value("all")
    browser.find_element(By.ID, "filter-rollback").click()
    visible = [a for a in browser.find_elements(By.CSS_SELECTOR, "article.trajectory") if a.is_displayed()]
    assert {a.get_attribute("data-kind") for a in visible} == {"regular", "negative"}
    assert all(a.get_attribute("data-rollbacks") != "0" or a.get_attribute("data-kind") == "negative" for a in visible)
    # A negative sample links to the rollout it came from.
    link = browser.find_element(By.CSS_SELECTOR, "article.kind-negative .question a")
    assert link.get_attribute("href").endswith("#s1-r0")

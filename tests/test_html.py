"""matrix.html in a real headless browser (Debian's chromium through selenium + chromedriver), as users open it.

Skips with the reason where chromium, chromedriver or selenium is missing. The screenshot is saved under
pytest's tmp dir (recorded as the `screenshot` property); set FREEZECOMPAT_SCREENSHOT=FILE to keep a copy.
"""

import os
import re
import shutil
from importlib import resources
from pathlib import Path

import pytest

from pytest_freezecompat.report import html, write

HOSTILE = '<img src=x onerror="window.__pwned=1"> & "quotes" </script>'
ENVS = {"torch": {"python": "3.11.7", "torch": "2.13.0", "frameworks": {"torch": "2.13.0"}, "device": "cpu",
                  "backend": "gloo"},
        "colossalai": {"python": "3.11.7", "torch": "2.5.1", "frameworks": {"colossalai": "0.5.0"}, "device": "cpu",
                       "backend": "gloo"}}
KNOWN = {"id": "torch-fsdp1-uniform-requires-grad", "link": "https://github.com/pytorch/pytorch/issues/91167",
         "links": ["https://github.com/pytorch/pytorch/issues/91167"], "summary": "FlatParameter must be uniform"}


def cell(framework="torch", plugin="ddp", checkpoint="none", freeze="none", status="pass", **extra):
    record = {"id": f"tiny-gpt/{framework}/{plugin}/eager/{checkpoint}/{freeze}", "model": "tiny-gpt",
              "framework": framework, "plugin": plugin, "init": "eager", "checkpoint": checkpoint, "freeze": freeze,
              "environment": framework, "status": status, "check": None, "message": "", "notes": [],
              "grad_access": "param.grad", "grad_norm_source": "torch.nn.utils.clip_grad_norm_",
              "repro": f"pytest --freeze-matrix --freeze-matrix-select framework={framework},plugin={plugin}",
              "rank_details": [], "emulation": False, "precision": "fp32", "world_size": 2}
    return {**record, **extra}


def sample_report():
    error_ranks = [{"rank": r, "phase": "wrap (fsdp1)", "error": {"type": "ValueError", "message": HOSTILE,
                    "where": "flat_param.py:822 in _validate", "phase": "wrap (fsdp1)"},
                    "traceback": f"Traceback (most recent call last):\nValueError: {HOSTILE}\n"} for r in (0, 1)]
    cells = [
        cell(),
        cell(checkpoint="reentrant", freeze="lora", status="fail", check="grads", message="no grad on trainable"),
        cell(plugin="fsdp1", freeze="lora", status="error", message=f"ValueError: {HOSTILE}", rank_details=error_ranks,
             known_issue={**KNOWN, "expected": True}),
        cell(plugin="fsdp1", freeze="none", status="pass", known_issue={**KNOWN, "fixed": True}),
        cell(framework="colossalai", plugin="low-level-zero-1", freeze="lora", emulation=True,
             grad_access="optimizer.get_param_grad(p)",
             rank_details=[{"rank": 0, "phase": "done", "emulated": ["accelerator device check"]}]),
        cell(framework="colossalai", plugin="gemini", freeze="lora", status="skip", message="Gemini needs CUDA",
             known_issue={"id": "colossalai-gemini-frozen-param-hook", "link": "https://github.com/hpcaitech/"
                          "ColossalAI/issues/5290", "summary": "param-op hook asserts"}),
        cell(framework="colossalai", plugin="gemini", freeze="none", status="timeout", message="no result in 120 s",
             rank_details=[{"rank": 1, "phase": "step 0", "stack": "File x.py, line 3 in wait"}]),
    ]
    return write.build(ENVS, cells)


def test_render_escapes_everything_and_needs_no_network():
    page = html.render(sample_report())
    assert HOSTILE not in page and "<img src=x" not in page
    assert "\\u003cimg src=x onerror=" in page  # inside the JSON block, as data
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=", page)  # nothing fetched
    assert "@import" not in page and "url(" not in page
    assert page.count('<button class="cell') == 7


def test_style_and_script_are_inlined_from_package_assets():
    page = html.render(sample_report())
    assets = resources.files(html.__package__) / "assets"
    for name in ("report.css", "report.js"):
        assert (assets / name).read_text(encoding="utf-8") in page


def _browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.skip("Debian's chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))


def test_matrix_html_in_a_headless_browser(tmp_path, record_property):
    write.write(tmp_path / "report", sample_report())
    browser = _browser(tmp_path)  # skips first where selenium or the browser is missing
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    try:
        browser.get((tmp_path / "report" / "matrix.html").as_uri())
        assert browser.title == "Freeze compatibility matrix"
        buttons = browser.find_elements(By.CSS_SELECTOR, "button.cell")
        assert len(buttons) == 7 and all(b.is_displayed() for b in buttons)
        shown = browser.find_element(By.ID, "shown")
        assert shown.text == "7 of 7 cells shown"
        torch = browser.find_element(By.CSS_SELECTOR, 'section[data-framework="torch"]')
        colossal = browser.find_element(By.CSS_SELECTOR, 'section[data-framework="colossalai"]')

        # filters hide and show
        framework = Select(browser.find_element(By.ID, "filter-framework"))
        framework.select_by_value("colossalai")
        assert not torch.is_displayed() and colossal.is_displayed() and shown.text == "3 of 7 cells shown"
        framework.select_by_value("")
        Select(browser.find_element(By.ID, "filter-plugin")).select_by_value("fsdp1")
        assert not colossal.is_displayed() and shown.text == "2 of 7 cells shown"
        assert not browser.find_element(By.CSS_SELECTOR, 'section[data-framework="torch"] th[data-plugin="ddp"]'
                                        ).is_displayed()
        Select(browser.find_element(By.ID, "filter-plugin")).select_by_value("")
        Select(browser.find_element(By.ID, "filter-freeze")).select_by_value("lora")
        assert shown.text == "4 of 7 cells shown"
        assert not browser.find_element(By.CSS_SELECTOR, 'section[data-framework="torch"] tr[data-freeze="none"]'
                                        ).is_displayed()
        Select(browser.find_element(By.ID, "filter-status")).select_by_value("known")
        visible = [b.get_attribute("data-id") for b in buttons if b.is_displayed()]
        assert visible == ["tiny-gpt/torch/fsdp1/eager/none/lora"]
        Select(browser.find_element(By.ID, "filter-status")).select_by_value("")
        Select(browser.find_element(By.ID, "filter-freeze")).select_by_value("")
        assert shown.text == "7 of 7 cells shown"

        # a click opens the cell's details: message, failed check, ranks, known issue, emulation, repro
        panel = browser.find_element(By.ID, "details")
        assert not panel.is_displayed()
        browser.find_element(By.CSS_SELECTOR, 'button[data-id="tiny-gpt/colossalai/low-level-zero-1/eager/none/lora"]'
                             ).click()
        assert panel.is_displayed()
        text = panel.get_attribute("textContent")  # not .text: CSS upper-cases the headings
        assert "yes (CUDA-on-CPU shim): accelerator device check" in text and "optimizer.get_param_grad(p)" in text
        browser.find_element(By.CSS_SELECTOR, 'button[data-id="tiny-gpt/torch/ddp/eager/reentrant/lora"]').click()
        text = panel.get_attribute("textContent")
        assert "failed check: grads" in text and "no grad on trainable" in text
        browser.find_element(By.CSS_SELECTOR, 'button[data-id="tiny-gpt/torch/fsdp1/eager/none/lora"]').click()
        text = panel.get_attribute("textContent")
        assert "tiny-gpt/torch/fsdp1/eager/none/lora" in text and HOSTILE in text
        assert "rank 1 — last phase: wrap (fsdp1)" in text and "flat_param.py:822" in text
        assert "torch-fsdp1-uniform-requires-grad" in text and "pytest --freeze-matrix" in text
        assert panel.find_element(By.CSS_SELECTOR, "a").get_attribute("href") == KNOWN["link"]
        assert browser.execute_script("return window.__pwned") is None  # the message stayed text

        screenshot = tmp_path / "matrix-html.png"
        assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
        record_property("screenshot", str(screenshot))
        if os.environ.get("FREEZECOMPAT_SCREENSHOT"):
            shutil.copyfile(screenshot, Path(os.environ["FREEZECOMPAT_SCREENSHOT"]))

        browser.find_element(By.ID, "close").click()
        assert not panel.is_displayed()
    finally:
        browser.quit()

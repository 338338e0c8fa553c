"""The page `loupe serve` shows at `/`, driven in a real browser: headless Chromium (Debian's chromium and
chromium-driver, which `make test` installs through its `browser` target) under selenium.

The server runs with the scripted `ZoomingEngine` (tests/serve_helpers.py: zoom into the middle, then into the
middle of that crop, answer the colour of the last crop's middle pixel). The pictures are real tasks of the
default's zoom family (params.yaml's data.zoom: depth 2, frames in a 1x3 grid), each drawn alone with
`draw_zoom_task` (about 0.1 s; no task set is written): test-split tasks whose frame sits in the middle cell, so
their answer patch lies at the canvas's centre and the scripted search, reading the server's crops, must answer
the task's own answer.

- A search: a PNG uploaded through the file input, a question typed, Ask pressed; the page draws both zoom boxes
  over the picture (the second inside the first, both on the picture), shows each crop in a turn card, and the
  answer. A screenshot is kept: $LOUPE_TEST_ARTIFACTS/serve_page.png when that variable is set, else under the
  test's tmp_path.
- A refusal: a file that is not an image (named .png) is answered 400; the page shows the server's message in
  #status.err and no answer, and stays usable: the next valid upload is searched and answered.

About 15 s for both on 2 cores (each starts its own Chromium, 1-2 s; 35 s with another job on the cores).
Skipped when chromium or chromedriver is missing.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image
from serve_helpers import ZoomingEngine, colour_name, running

from loupe.config import load_section
from loupe.data.families import DataParams
from loupe.data.zoom_tasks import draw_zoom_task
from loupe.serve.main import build_server

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (requirements/cpu.txt)")
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parents[1]
ANSWER_TIMEOUT_S = 60


def browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or next((p for p in ["/usr/bin/chromedriver"] if Path(p).exists()), None)
    if not chromium or not driver:
        pytest.skip("needs Debian's chromium and chromium-driver (`make test` installs them: its `browser` target)")
    return chromium, driver


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    chromium, driver_path = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.delenv("LOUPE_API_KEY", raising=False)  # the page's own key field is not what is tested here
    built = build_server(None, ROOT / "params.yaml", [], engine=ZoomingEngine())
    try:
        with running(built.app) as url:
            yield url
    finally:
        built.scheduler.close()


def middle_tasks(count: int) -> list[tuple[Image.Image, str, str]]:
    """(canvas, question, answer) of the first `count` test-split tasks of the default's zoom family whose frame is
    in the middle cell: the answer patch is at the canvas's centre, where the scripted engine looks."""
    zoom = load_section(DataParams, "data", ROOT / "params.yaml").zoom
    found = []
    for index in range(40):
        record, canvas, layout = draw_zoom_task(zoom, "test", index)
        x0, y0, x1, y1 = layout["patches"][0]
        if x0 <= canvas.width // 2 < x1 and y0 <= canvas.height // 2 < y1:
            found.append((canvas, record.problem, record.solution))
            if len(found) == count:
                return found
    raise AssertionError("no test task of the default's zoom family has its frame in the middle cell")


def save_png(image: Image.Image, path: Path) -> Path:
    image.save(path, format="PNG")
    return path


def ask(driver, url: str, picture: Path, question: str) -> None:
    """Choose `picture` in the file input (a real upload: the page reads the file), type `question`, press Ask."""
    if driver.current_url.rstrip("/") != url:
        driver.get(url + "/")
    shown = "return document.getElementById('picture').src"
    before = driver.execute_script(shown)
    driver.find_element(By.ID, "file").send_keys(str(picture))
    # The page takes the file once its FileReader is done (it then shows it as the picture): wait for that, as a
    # user would see it, before asking.
    WebDriverWait(driver, 10).until(lambda d: (src := d.execute_script(shown)).startswith("data:") and src != before)
    field = driver.find_element(By.ID, "question")
    field.clear()
    field.send_keys(question)
    driver.find_element(By.ID, "go").click()


def wait_for_answer(driver) -> str:
    def answered(d):
        found = d.find_elements(By.CSS_SELECTOR, "#answer.final")
        if found:
            return found[0]
        status = d.find_elements(By.CSS_SELECTOR, "#status.err")
        if status:
            raise AssertionError(f"the page shows an error instead of an answer: {status[0].text!r}")
        return False

    return WebDriverWait(driver, ANSWER_TIMEOUT_S).until(answered).text


def boxes(driver) -> list[list[float]]:
    """Each drawn box as [x0, y0, x1, y1], fractions of the picture (the SVG's viewBox is the unit square)."""
    out = []
    for rect in driver.find_elements(By.CSS_SELECTOR, "svg#boxes rect.box"):
        x, y, w, h = (float(rect.get_attribute(name)) for name in ("x", "y", "width", "height"))
        out.append([x, y, x + w, y + h])
    return out


def inside(inner, outer, slack: float = 0.0) -> bool:
    return (inner[0] >= outer[0] - slack and inner[1] >= outer[1] - slack
            and inner[2] <= outer[2] + slack and inner[3] <= outer[3] + slack)


def screenshot_path(tmp_path: Path) -> Path:
    folder = os.environ.get("LOUPE_TEST_ARTIFACTS")
    folder = Path(folder) if folder else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "serve_page.png"


@pytest.mark.timeout(240)
def test_the_page_draws_the_search_and_shows_the_answer(server, browser, tmp_path):
    (canvas, question, answer), = middle_tasks(1)
    middle = canvas.getpixel((canvas.width // 2, canvas.height // 2))
    assert colour_name(middle) == answer  # what ZoomingEngine must answer: the colour at the centre
    picture = save_png(canvas, tmp_path / "zoom-task.png")

    ask(browser, server, picture, question)
    assert wait_for_answer(browser) == f"Answer: {answer}"

    # Two boxes, as fractions of the picture: the first zoom on the middle, the second inside it.
    first, second = boxes(browser)
    assert first == pytest.approx([0.35, 0.35, 0.65, 0.65], abs=0.01)
    assert inside(second, first)
    assert second == pytest.approx([0.44, 0.44, 0.56, 0.56], abs=0.01)  # 0.3-0.7 of the first zoom's region
    assert browser.find_elements(By.CSS_SELECTOR, "svg#boxes rect.box.latest")[0].get_attribute("data-turn") == "2"
    # ... and where the page draws them on screen: over the picture, around its centre.
    shown = browser.find_element(By.ID, "picture").rect
    assert shown["width"] > 300 and shown["height"] > 300
    on_screen = [r.rect for r in browser.find_elements(By.CSS_SELECTOR, "svg#boxes rect.box")]
    as_box = [[r["x"], r["y"], r["x"] + r["width"], r["y"] + r["height"]] for r in on_screen]
    picture_box = [shown["x"], shown["y"], shown["x"] + shown["width"], shown["y"] + shown["height"]]
    assert inside(as_box[0], picture_box, slack=2) and inside(as_box[1], as_box[0], slack=2)
    centre = (shown["x"] + shown["width"] / 2, shown["y"] + shown["height"] / 2)
    for box in as_box:
        assert abs((box[0] + box[2]) / 2 - centre[0]) < 4 and abs((box[1] + box[3]) / 2 - centre[1]) < 4
    assert as_box[0][2] - as_box[0][0] == pytest.approx(0.3 * shown["width"], rel=0.05)

    # Each crop in a turn card, as an image the browser decoded; the model's turns in theirs.
    crops = browser.find_elements(By.CSS_SELECTOR, "div.turn.crop img")
    assert len(crops) == 2
    for img in crops:
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) > 0
    assert len(browser.find_elements(By.CSS_SELECTOR, "div.turn.assistant")) == 3
    assert "done in 3 turns (answered)" in browser.find_element(By.ID, "status").text

    browser.execute_script("window.scrollTo(0, 0)")
    shot = screenshot_path(tmp_path)
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    with Image.open(shot) as image:
        assert image.format == "PNG" and image.width >= 1000 and image.height >= 600


@pytest.mark.timeout(240)
def test_a_refused_upload_shows_the_servers_message_and_the_page_stays_usable(server, browser, tmp_path):
    fake = tmp_path / "not-an-image.png"
    fake.write_bytes(b"this is a text file, not a PNG\n" * 40)
    ask(browser, server, fake, "What colour is the small square?")
    status = WebDriverWait(browser, ANSWER_TIMEOUT_S).until(
        lambda d: (d.find_elements(By.CSS_SELECTOR, "#status.err") or [False])[0])
    assert status.is_displayed()
    assert status.text.startswith("400: ") and "not an image" in status.text, status.text
    assert not browser.find_element(By.ID, "answer").is_displayed()
    assert boxes(browser) == [] and browser.find_elements(By.CSS_SELECTOR, "div.turn") == []
    assert browser.find_element(By.ID, "go").is_enabled()

    (canvas, question, answer), = middle_tasks(1)
    ask(browser, server, save_png(canvas, tmp_path / "zoom-task.png"), question)
    assert wait_for_answer(browser) == f"Answer: {answer}"
    assert browser.find_elements(By.CSS_SELECTOR, "#status.err") == []
    assert len(boxes(browser)) == 2

"""grove.Image.build against a real groved: a build with its log, a cached rebuild, a Dockerfile error."""

import pytest

import grove


def test_build_logs_caches_and_names_the_line(client, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM debian12\nCOPY a.txt /a.txt\nRUN cat /a.txt\nCMD [\"cat\", \"/a.txt\"]\n")
    (tmp_path / "a.txt").write_text("from-the-context\n")
    (tmp_path / ".dockerignore").write_text("junk\n")
    (tmp_path / "junk").write_text("x" * 1000)
    log = []
    img = grove.Image.build(str(tmp_path), "pybuilt", on_log=log.append, client=client)
    assert img.name == "pybuilt" and img.info["config"]["cmd"] == ["cat", "/a.txt"]
    assert "from-the-context\n" in "".join(log)
    log.clear()
    grove.Image.build(str(tmp_path), "pybuilt", on_log=log.append, client=client)
    assert "from-the-context\n" not in "".join(log) and "(cached)" in "".join(log)
    with grove.Sandbox.create(image="pybuilt", client=client) as sbx:
        assert sbx.exec("cat /a.txt; test ! -e /junk && echo ok").stdout == "from-the-context\nok\n"
    (tmp_path / "Dockerfile").write_text("FROM debian12\nRUN true\nVOLUME /v\n")
    with pytest.raises(grove.InvalidRequest) as e:
        grove.Image.build(str(tmp_path), "pybuilt2", client=client)
    assert "line 3" in str(e.value)
    (tmp_path / "Dockerfile").write_text("FROM debian12\nRUN exit 7\n")
    with pytest.raises(grove.GroveError) as e:
        grove.Image.build(str(tmp_path), "pybuilt2", client=client)
    assert "line 2" in str(e.value) and "code 7" in str(e.value)
    client.request("DELETE", "/v1/images/pybuilt")

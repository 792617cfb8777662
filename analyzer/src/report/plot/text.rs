//! Text rasterised into an RGB buffer with the embedded font, for the PNG
//! plots. plotters' own bitmap text (its `ab_glyph` backend, 0.3.7) drops
//! each glyph's left bearing and truncates the pen position per glyph, so
//! "threshold" reads "thresh old"; this places every glyph at its bearing,
//! with kerning, and blends its coverage.

use ab_glyph::{Font, FontRef, PxScale, ScaleFont, point};
use plotters::prelude::RGBColor;

/// Horizontal anchor: which part of the text sits at the given x.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Align {
    Start,
    Middle,
    End,
}

/// Vertical anchor: which part of the text's line box sits at the given y.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Baseline {
    Top,
    Center,
}

/// How to draw a piece of text.
#[derive(Debug, Clone, Copy)]
pub(super) struct Style {
    /// Height of the line box (ascent minus descent), in pixels.
    pub(super) px: f32,
    pub(super) color: RGBColor,
    pub(super) align: Align,
    pub(super) baseline: Baseline,
    /// Turned a quarter anticlockwise, reading upwards (a y-axis label).
    pub(super) upright: bool,
}

impl Style {
    pub(super) fn new(px: f32) -> Style {
        Style {
            px,
            color: RGBColor(0, 0, 0),
            align: Align::Start,
            baseline: Baseline::Top,
            upright: false,
        }
    }

    pub(super) fn at(self, align: Align, baseline: Baseline) -> Style {
        Style {
            align,
            baseline,
            ..self
        }
    }

    pub(super) fn upright(self) -> Style {
        Style {
            upright: true,
            ..self
        }
    }
}

/// An RGB buffer, row-major, 3 bytes per pixel.
#[derive(Debug)]
pub(super) struct Canvas<'a> {
    pub(super) rgb: &'a mut [u8],
    pub(super) width: u32,
    pub(super) height: u32,
}

fn font() -> Result<FontRef<'static>, String> {
    FontRef::try_from_slice(super::font::DEJAVU_SANS)
        .map_err(|_| "the embedded DejaVu Sans does not parse as a font".to_owned())
}

/// The width of `s` at `px`, in pixels.
///
/// # Errors
/// When the embedded font does not parse (a broken build).
pub(super) fn width(s: &str, px: f32) -> Result<f32, String> {
    let font = font()?;
    let scaled = font.as_scaled(PxScale::from(px));
    let mut pen = 0.0;
    let mut prev = None;
    for c in s.chars() {
        let id = scaled.glyph_id(c);
        if let Some(p) = prev {
            pen += scaled.kern(p, id);
        }
        pen += scaled.h_advance(id);
        prev = Some(id);
    }
    Ok(pen)
}

impl Canvas<'_> {
    /// Draws `s` with its anchor at `(x, y)`.
    ///
    /// # Errors
    /// When the embedded font does not parse (a broken build).
    pub(super) fn text(&mut self, s: &str, (x, y): (i32, i32), style: Style) -> Result<(), String> {
        let font = font()?;
        let scaled = font.as_scaled(PxScale::from(style.px));
        let (ascent, descent) = (scaled.ascent(), scaled.descent());
        let w = width(s, style.px)?;
        let h = ascent - descent;
        // The text's own frame: x along the line, y down from the line box's top.
        let dx = match style.align {
            Align::Start => 0.0,
            Align::Middle => -w / 2.0,
            Align::End => -w,
        };
        let dy = match style.baseline {
            Baseline::Top => 0.0,
            Baseline::Center => -h / 2.0,
        };
        let mut pen = 0.0;
        let mut prev = None;
        for c in s.chars() {
            let id = scaled.glyph_id(c);
            if let Some(p) = prev {
                pen += scaled.kern(p, id);
            }
            let glyph = id.with_scale_and_position(style.px, point(pen + dx, ascent + dy));
            pen += scaled.h_advance(id);
            prev = Some(id);
            let Some(outline) = font.outline_glyph(glyph) else {
                continue;
            };
            let bounds = outline.px_bounds();
            outline.draw(|gx, gy, coverage| {
                // Glyph pixel in the text's frame, then onto the canvas.
                let (lx, ly) = (
                    bounds.min.x as i32 + gx as i32,
                    bounds.min.y as i32 + gy as i32,
                );
                let (px, py) = if style.upright {
                    (x + ly, y - lx)
                } else {
                    (x + lx, y + ly)
                };
                self.blend(px, py, style.color, coverage);
            });
        }
        Ok(())
    }

    fn blend(&mut self, x: i32, y: i32, color: RGBColor, coverage: f32) {
        let (Ok(x), Ok(y)) = (u32::try_from(x), u32::try_from(y)) else {
            return;
        };
        if x >= self.width || y >= self.height {
            return;
        }
        let i = (y as usize * self.width as usize + x as usize) * 3;
        let a = coverage.clamp(0.0, 1.0);
        for (channel, target) in self.rgb[i..i + 3]
            .iter_mut()
            .zip([color.0, color.1, color.2])
        {
            let mixed = f32::from(*channel) * (1.0 - a) + f32::from(target) * a;
            *channel = mixed.round() as u8;
        }
    }
}
